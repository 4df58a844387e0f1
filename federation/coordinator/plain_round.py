"""The plain round: each site's update travels decodable by the coordinator (compressed, signed,
maybe sealed; not masked). Every update is decoded through the coordinator's side of the pipeline
(open the envelope, then decode the codec), checked, and folded into a running weighted mean as
soon as it is pulled, so the coordinator holds O(P) memory however many sites answer.

Memory: every checked update goes to a file of its own (spilled_mean.py) and the mean
is folded from the files once the stage is over. A dense update in a signed or sealed envelope
(no codec: the case at size) is opened chunk by chunk straight into its file, never held whole;
a codec's payload (int8, top-k, ...) is decoded in memory, then spilled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from crypto.envelope import ReplayGuard
from crypto.pki import CoordinatorBundle
from federation.config.schema import FederationConfig
from federation.coordinator.envelope_opener import CoordinatorProtection
from federation.coordinator.spilled_mean import SpilledMean, clear_stale
from federation.coordinator.strategy import Exchange, ExchangeResult, Reply, RoundInput, RoundOutcome, Step, site_metrics
from federation.protocol import message_keys as keys
from federation.protocol.codecs import UpdateSpec
from federation.protocol.payload_records import from_records
from federation.protocol.pipeline import Pipeline, UpdateRejected, check_update
from federation.protocol.status_record import num_examples
from federation.protocol.update_codec import CodecStage
from federation.protocol.wire_dtypes import master_spec, to_master


@dataclass
class PlainState:
    """One plain round in progress."""

    inp: RoundInput
    pipeline: Pipeline
    mean: SpilledMean
    out: RoundOutcome = field(default_factory=lambda: RoundOutcome(None, 0))
    stream: CoordinatorProtection | None = None  # set when updates are opened straight into files


class PlainRound:
    """`Strategy` of one train stage: send the model, decode, check and average the updates."""

    aborts: tuple[type[BaseException], ...] = ()
    messages = 1  # a round's messages to each site: the train message (the round planner's fixed cost)

    def __init__(self, fed: FederationConfig, bundle: CoordinatorBundle | None, replay: ReplayGuard,
                 spill_dir: Path | None = None):
        self.fed, self.bundle, self.replay = fed, bundle, replay
        self.spill_dir = spill_dir  # where updates wait for the fold (None: the system's temp directory)
        if spill_dir is not None:
            clear_stale(spill_dir)

    def begin(self, inp: RoundInput) -> PlainState:
        """A fresh state, with the coordinator's side of the pipeline (its stages keep timings)."""
        stages: list = []
        codec = inp.codec or self.fed.codec  # the round's (round_target_s may choose it per round)
        if codec != "identity":
            stages.append(CodecStage.from_spec(codec, self.fed.error_feedback, layout=UpdateSpec.of(inp.model)))
        protection = None
        if self.bundle is not None:
            protection = CoordinatorProtection(self.bundle, require_sealed=self.fed.seal, replay=self.replay)
            stages.append(protection)
        stream = protection if codec == "identity" else None  # the dense payload is the update itself
        return PlainState(inp, Pipeline(tuple(stages)), SpilledMean(inp.spec, self.spill_dir), stream=stream)

    def steps(self) -> tuple[Step[PlainState], ...]:
        """One stage: train."""
        return (Step(self.configure_train, self.aggregate_train, self.receive_update),)

    def configure_train(self, st: PlainState) -> Exchange:
        """The model message to every sampled site."""
        deadline = self.fed.deadlines.round_s
        return Exchange("train", "train", st.inp.nodes, st.inp.model_message(deadline), deadline)

    def receive_update(self, st: PlainState, reply: Reply) -> None:
        """Decode, check and spill one site's update; a bad one is rejected with its reason and
        leaves nothing behind."""
        content = reply.message.content
        path = None
        try:
            # read-only views into the reply (a sealed body is read straight from the data path's map)
            payload = from_records(content, keys.UPDATE, keys.UPDATE_META, copy=False)
            ctx = st.inp.ctx.for_site(reply.name)
            if st.stream is not None:  # opened chunk by chunk into its file, checked there
                path = st.mean.new_file(reply.name)
                layout, _ = st.stream.decode_to_file(payload, ctx, path)
                n = self._weight(reply)
                st.mean.add_file(reply.name, path, layout, n)
            else:
                payload = st.pipeline.decode(payload, ctx)
                arrays = to_master(payload.arrays, st.inp.spec)  # bf16 words: exact float32 (accumulated so)
                check_update(arrays, master_spec(st.inp.spec))
                st.mean.add_arrays(reply.name, arrays, self._weight(reply))
        except UpdateRejected as err:
            if path is not None:
                st.mean.discard(path)
            st.out.reject(reply.name, err.reason, err.detail)
            return
        except OSError as err:  # the spill directory: full or unwritable disk; the round goes on without it
            if path is not None:
                st.mean.discard(path)
            st.out.reject(reply.name, "spill_failed", f"could not write the update under {st.mean.directory}: "
                          f"{err}; free disk space there (an update needs its own size until the round ends)")
            return
        except BaseException:
            if path is not None:
                st.mean.discard(path)
            raise
        st.out.per_site[reply.name] = site_metrics(reply)

    @staticmethod
    def _weight(reply: Reply) -> int:
        n = num_examples(reply.status)  # StatusError (an UpdateRejected) if not an int
        if n <= 0:
            raise UpdateRejected("bad_num_examples", f"num_examples is {n}")
        return n

    def aggregate_train(self, st: PlainState, result: ExchangeResult) -> None:
        """The sites that did not answer, or answered with an error."""
        st.out.failed.update(result.failed)

    def finish(self, st: PlainState) -> RoundOutcome:
        """The weighted mean of the usable updates, still on disk (None if there is none): the
        server optimizer folds it (`ServerOptimizer.step`)."""
        st.out.count = st.mean.count
        st.out.mean = st.mean if st.mean.count else None
        st.out.extra["decode_s"] = sum(getattr(s, "decode_s", 0.0) for s in st.pipeline.stages)
        return st.out
