"""How often the coordinator asks the SuperLink for replies while a stage waits.

Each poll is a request to the SuperLink, one per pending message in a streamed stage (replies are
pulled one at a time so that the coordinator holds at most `federation.receive_workers` large
ones), and each costs the SuperLink and the ServerApp CPU that the sites' trainers and ClientApps on the same cores wait for.
A reply from a real SuperNode cannot come back sooner than the SuperNode's next pull, a fresh
ClientApp process (about half a second of imports) and the SuperNode's 0.5 s check for its reply
(flwr 1.41). So after the first pull, which is immediate and finds every reply of an in-process
grid, the schedule waits `FIRST_WAIT_S`, then polls every `STEADY_S`; a reply does not make it poll
faster, since the other sites answer independently of it. Flower's own `send_and_receive` polls
every 3 s; `STEADY_S` keeps the coordinator's reaction to a reply within a quarter of a second.
"""

from __future__ import annotations

FIRST_WAIT_S = 0.5  # after the push: no SuperNode can answer sooner
STEADY_S = 0.25  # then: a reply waits at most this long on the SuperLink


class PollSchedule:
    """The waits between the pulls of one wait for replies."""

    def __init__(self) -> None:
        self.polls = 0

    def next_wait(self) -> float:
        """Seconds to sleep before the next pull."""
        self.polls += 1
        return FIRST_WAIT_S if self.polls == 1 else STEADY_S
