"""How soon a site's SuperNode asks its SuperLink for the next message after a reply.

Flower's SuperNode sleeps 3 s after a pull that found nothing and looks for a ClientApp's reply
every 0.5 s, both hard-coded in flwr 1.41; a round's next message, sent soon after a site's reply,
then waits most of that sleep. The sites sovfl starts run the SuperNode through
federation/ops/supernode_main.py, which shortens those sleeps as set here.
"""

from __future__ import annotations

from pydantic import Field

from federation.config.strict import StrictModel

SUPERNODE_POLLS_ENV = "SOVFL_SUPERNODE_POLLS"
FLOWER_IDLE_SLEEP_S = 3  # flwr 1.41: after a pull that found nothing
FLOWER_REPLY_CHECK_S = 0.5  # flwr 1.41: between looks for the ClientApp's reply (and its content)


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
