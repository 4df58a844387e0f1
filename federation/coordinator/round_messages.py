"""What a round's messages say: the round's identity and config, and the global model message.

The strategies (plain_round.py, secagg_round.py, evaluation.py) are handed `model_message`, which
serializes the global model once per stage (with a downlink codec: each site's encoded steps,
downlink_sender.py; for a site on the data path: into the offer file, tensor by tensor) and adds
each site's round config.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import RecordDict

from federation.config.schema import ExperimentConfig
from federation.coordinator.bulk_path import BulkPath
from federation.coordinator.round_planner import RoundPlanner
from federation.coordinator.roster import Roster
from federation.coordinator.run_state import RunState
from federation.protocol import message_keys as keys
from federation.protocol.pipeline import RoundContext
from federation.protocol.round_config import RoundConfig
from federation.protocol.update_codec import round_seed
from federation.protocol.wire_dtypes import WireCopy


class RoundMessages:
    """The round config and model message of each round, from the run's state and the roster."""

    def __init__(self, cfg: ExperimentConfig, run_id: int, roster: Roster, state: Callable[[], RunState],
                 wire_copy: WireCopy, bulk: BulkPath | None, planner: RoundPlanner | None):
        self.cfg, self.fed, self.run_id, self.roster, self.state = cfg, cfg.federation, run_id, roster, state
        self.wire_copy, self.bulk, self.planner = wire_copy, bulk, planner

    def seed(self, rnd: int) -> int:
        """The public seed of round `rnd` (shared-seed codecs)."""
        return round_seed(self.fed.seed, rnd)

    def context(self, rnd: int) -> RoundContext:
        """The round's identity, for the coordinator's side of the pipeline."""
        return RoundContext(self.fed.name, self.run_id, rnd, "", self.seed(rnd))

    def codec(self, rnd: int) -> str:
        """The update codec of round `rnd`: round_target_s's choice, else `federation.codec`."""
        choice = self.planner.choices.get(rnd) if self.planner is not None else None
        return choice.codec if choice is not None else self.fed.codec

    def config(self, rnd: int, deadline_s: float, evaluate: bool = False) -> RoundConfig:
        """The CONFIG record of a stage's messages."""
        choice = self.planner.choices.get(rnd) if self.planner is not None else None
        return RoundConfig(round=rnd, federation=self.fed.name, update_kind=self.fed.update_kind,
                           seed=self.seed(rnd), codec=self.codec(rnd), error_feedback=self.fed.error_feedback,
                           seal=self.fed.seal, evaluate=evaluate, overlap=self.fed.overlap,
                           overlap_max_steps_factor=self.fed.overlap_max_steps_factor,
                           local_steps=choice.local_steps if choice else None,
                           # the site must answer before our deadline, ClientApp start-up (a few seconds) included
                           deadline_s=max(1.0, deadline_s * 0.8 - 2.0))

    def aggregated_rounds(self, rnd: int) -> dict[str, int]:
        """site -> the newest round before `rnd` whose update from it is in the global model (0:
        none); a resume restores `RunState.aggregated` from the checkpoint's history."""
        last = {s.id: 0 for s in self.cfg.sites}
        for r, sites in self.state().aggregated.items():
            for site in sites:
                if site in last and r < rnd:
                    last[site] = max(last[site], r)
        return last

    def model_message(self, rnd: int, deadline_s: float, evaluate: bool = False) -> Callable[[int], RecordDict]:
        """The global model (with a downlink codec: the encoded steps from the model each site holds,
        coordinator/downlink_sender.py) and the round config, serialized once per stage and content
        and shared by the messages. `evaluate`: sites evaluate it before training on it."""
        st = self.state()
        down = st.model if st.downlink.codec is not None else self.wire_copy.of(st.model)
        bulk, known_name = self.bulk, self.roster.known_name

        def offer(node: int):  # a site on the data path: the model written to its offer file tensor by tensor
            return bulk.offer_arrays if bulk is not None and bulk.direct(known_name(node)) else None
        records = st.downlink.stage(down, self.roster.site_name, offer)
        config, last = self.config(rnd, deadline_s, evaluate), self.aggregated_rounds(rnd)

        def message(node: int) -> RecordDict:  # each site's config names only its own last aggregated round
            name = known_name(node)
            own = config.model_copy(update={"aggregated": [f"{name}:{last.get(name, 0)}"]}) if name else config
            return RecordDict({**records(node), keys.CONFIG: own.to_record()})
        return message
