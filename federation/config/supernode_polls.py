"""How soon a site's SuperNode asks its SuperLink for the next message after a reply.

Flower's SuperNode sleeps 3 s after a pull that found nothing, looks for a ClientApp's reply every
0.5 s and asks again for a message object not at the SuperLink yet after 1 s, all hard-coded in
flwr 1.41; a round's next message, sent soon after a site's reply, then waits most of the first
sleep, and a message taken while the coordinator still pushes its objects waits the last. The
sites sovfl starts run the SuperNode through federation/ops/supernode_main.py, which shortens
those waits as set here.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from federation.config.strict import StrictModel

SUPERNODE_POLLS_ENV = "SOVFL_SUPERNODE_POLLS"
FLOWER_IDLE_SLEEP_S = 3  # flwr 1.41: after a pull that found nothing
FLOWER_REPLY_CHECK_S = 0.5  # flwr 1.41: between looks for the ClientApp's reply (and its content)
FLOWER_OBJECT_RETRY_S = 1.0  # flwr 1.41: first wait before asking again for a message object not at the SuperLink yet
FLOWER_OBJECT_WAIT_S = 5000.0  # flwr 1.41: about how long one message object is waited for (500 tries, 1-10 s apart)


class SupernodePolls(StrictModel):
    """`federation.supernode_polls`: how soon a site's SuperNode asks for its next message after a reply."""

    enabled: bool = Field(True, description="false: the SuperNode sleeps as Flower ships it (3 s after an empty "
                          "pull, 0.5 s between looks for a reply)")
    first_s: float = Field(0.1, gt=0, le=FLOWER_IDLE_SLEEP_S, description="sleep after the first empty pull that "
                           "follows a reply")
    growth: float = Field(1.5, ge=1.1, le=10, description="each further empty pull's sleep is this times the last, "
                          "up to Flower's 3 s")
    reply_check_s: float = Field(0.05, gt=0, le=FLOWER_REPLY_CHECK_S, description="between looks for the "
                                 "ClientApp's reply (Flower's 0.5 s)")
    object_retry_s: float = Field(0.05, gt=0, le=FLOWER_OBJECT_RETRY_S, description="first wait before asking "
                                  "the SuperLink again for a message object the coordinator is still pushing "
                                  "(Flower's 1 s); each further wait doubles, up to `object_retry_cap_s`")
    object_retry_cap_s: float = Field(0.5, gt=0, le=10, description="the longest wait between asks for one "
                                      "message object (Flower's 10 s)")

    @model_validator(mode="after")
    def _cap_covers_first(self) -> "SupernodePolls":
        if self.object_retry_cap_s < self.object_retry_s:
            raise ValueError(f"object_retry_cap_s ({self.object_retry_cap_s}) is below object_retry_s "
                             f"({self.object_retry_s}): set the cap at least as long as the first wait")
        return self
