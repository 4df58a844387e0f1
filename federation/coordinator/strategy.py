"""Rounds as strategies over messages: the interface between a strategy and the driver.

A strategy (PlainRound, SecAggRound, Admission, Evaluation) is a fixed sequence of `Step`s over a
state object of its own. Each step builds one stage's messages (`configure` -> an `Exchange`) and
folds the replies (`receive`, one reply at a time as it is pulled, and/or `aggregate`, once the
stage is over); `finish` turns the state into the strategy's outcome. A strategy never sees the
Grid, the clock or the `Coordinator`: the driver (driver.py, exchange.py) owns sending, deadlines, byte counts,
the run-wide counters and the metrics line, so the same strategy runs over a real SuperLink, the
in-process grid of simulations (federation/ops/inprocess.py) and the fakes of unit tests.

Modelled on Flower's `Strategy.configure_train` / `aggregate_train` (messages in, replies out,
`start()` owns the sending) and on `secaggplus_workflow.py` (one method per stage over a state
dataclass).

Because each strategy writes and reads only its own records (protocol/message_keys.py), stages of
different strategies addressed to the same sites share one message: a `Rider` adds its records to
the messages of whatever stage runs (and may ask for a message of its own to sites the stage does
not address), and sees every reply. That is how attestation (admission.py), the next SecAgg
round's setup (secagg_round.SetupRider) and evaluation (evaluation.py) ride on the train and
unmask messages without any of them knowing. State that must outlive a round lives on the strategy
object (Admission's verdicts, SecAggRound's pending setups) or the driver (model, optimizer,
downlink reference), never in a round's state; each such object says whether a resumed run may
restore it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from flwr.app import Message, RecordDict

from federation.protocol import message_keys as keys
from federation.protocol.codecs import Arrays
from federation.protocol.pipeline import RoundContext
from federation.protocol.status_record import StatusError, num_examples
from site_trainer.pii.transform import counts_from_metrics

S = TypeVar("S")
O = TypeVar("O", covariant=True)


@dataclass
class Site:
    """A site the coordinator knows: its Flower node, its name and its sample count at discovery,
    and the seconds per local step its trainer timed at its start (None: not given)."""

    node_id: int
    name: str
    num_examples: int
    step_s_estimate: float | None = None


@dataclass(frozen=True)
class Exchange:
    """One stage's messages, as a strategy asks the driver to send them."""

    stage: str  # how the driver names this stage in its log, e.g. "train" or "secagg stage 2"
    message_type: str  # Flower's message type: "query", "train" or "evaluate"
    nodes: Sequence[int]
    content: Callable[[int], RecordDict]  # the content of the message to one node
    deadline_s: float


@dataclass(frozen=True)
class Reply:
    """A good reply (the site's status says ok), with the name of the site that sent it."""

    name: str
    node: int
    message: Message

    @property
    def status(self):
        """The reply's STATUS record."""
        return self.message.content.config_records[keys.STATUS]


@dataclass
class ExchangeResult:
    """What the driver saw of one stage: failures by site, the replies (unless streamed), costs."""

    failed: dict[str, str] = field(default_factory=dict)  # site -> reason
    replies: list[Reply] = field(default_factory=list)  # empty when the step streams (`receive`)
    bytes_down: int = 0  # array bytes of the messages sent
    bytes_up: int = 0  # array bytes of the good replies
    seconds: float = 0.0
    push_s: float = 0.0  # building and pushing the messages
    wait_s: float = 0.0  # waiting for replies (the sites' work, Flower's delivery, our polling)
    receive_s: float = 0.0  # folding replies as they arrive (decoding, summing): wall seconds any fold ran
    receive_busy_s: float = 0.0  # the folds' own seconds added up (above receive_s when they overlapped)
    receive_spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # site -> its fold's (start, end), s after the push began
    by_node: dict[int, float] = field(default_factory=dict)  # node -> seconds until its reply was pulled
    msg_cost: dict[str, dict[str, float]] = field(default_factory=dict)  # site -> its message's seconds (message_cost.py)


@dataclass(frozen=True)
class Step(Generic[S]):
    """One stage of a strategy: build its messages, then fold the replies into the state.

    With `receive`, each good reply is handed over as soon as it is pulled and not kept (replies
    are pulled one at a time, so a stage of large replies holds at most one); without it the
    replies come to `aggregate` together. `configure` returning None skips the stage.

    `concurrent`: `receive` may run for several replies at once, each on a thread of its own
    (`federation.receive_workers` of them), so that one site's large reply is decoded while the
    next is pulled and decoded; the stage then holds at most that many replies. Only for a
    `receive` that guards its shared state and whose result does not depend on the order the
    replies are folded in (SecAgg+'s ring sum: integer addition modulo 2^32)."""

    configure: Callable[[S], Exchange | None]
    aggregate: Callable[[S, ExchangeResult], None]
    receive: Callable[[S, Reply], None] | None = None
    concurrent: bool = False


class Rider(Protocol):
    """Rides on the messages of other strategies' stages (see the module docstring).

    For every message the driver sends in a stage it asks each rider for records to add; rider
    records for a site the stage does not address (`wanted`) go in a query of their own, which
    the stage does not wait for (its reply is taken whenever it is pulled, until the driver ends
    the rider). Every reply the driver pulls, good or failed, is shown to every rider (`take`;
    None: the message got no reply by the stage's deadline)."""

    def records(self, node: int) -> dict:
        """Records to add to the message to `node` (key -> ConfigRecord), maybe none."""

    def wanted(self) -> list[int]:
        """Nodes that need a message now although the stage sends them none."""

    def take(self, node: int, reply: Message | None) -> None:
        """A reply of `node` (None: none came in time)."""


class Strategy(Protocol[S, O]):
    """What the driver runs: `steps` in order over a state the strategy made, then `finish`.

    An exception of a type in `aborts` ends the strategy early; the driver then asks the strategy's
    `abort(state, err)` (required when `aborts` is not empty) for the outcome: a SecAgg round that
    fell below its threshold, for example. How a strategy makes its state is its own business
    (`begin(...)`), since each needs different inputs."""

    aborts: tuple[type[BaseException], ...]

    def steps(self) -> Iterable[Step[S]]:
        """The stages, in the order they run."""

    def finish(self, state: S) -> O:
        """The outcome, once every stage ran."""


@dataclass
class RoundInput:
    """What a round strategy is given by the driver: this round's sites, model and message parts."""

    ctx: RoundContext  # federation, Flower run, round and the round's public seed (site left empty)
    nodes: list[int]  # the sampled (and admitted) sites
    sites: dict[int, Site]  # every known site, by node
    model: Arrays  # the global model the round starts from
    spec: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape): what an update must look like
    model_message: Callable[[float], Callable[[int], RecordDict]]  # a stage's model message, per node
    log: Callable[[str], None]
    codec: str | None = None  # the round's update codec (round_target_s chooses it per round); None: federation.codec

    @property
    def round(self) -> int:
        """The server round."""
        return self.ctx.round

    def name(self, node: int) -> str:
        """The site's name (node-<id> for a node that never said who it is)."""
        site = self.sites.get(node)
        return site.name if site else f"node-{node}"

    def names(self, nodes: Iterable[int]) -> dict[int, str]:
        """Names of several nodes."""
        return {n: self.name(n) for n in nodes}


@dataclass
class RoundOutcome:
    """What a round strategy hands back: the weighted mean update and the round's metrics parts."""

    mean: Arrays | None  # the sample-weighted mean update of the usable sites
    count: int  # how many sites' updates are in it
    per_site: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # site -> reason
    bytes_up: int = 0
    bytes_down: int = 0
    extra: dict = field(default_factory=dict)  # strategy-specific metrics
    rejections: Counter = field(default_factory=Counter)  # reason -> count, added to the run's

    def reject(self, name: str, reason: str, detail: str) -> None:
        """Count a rejected message under `reason` and name the site's failure."""
        self.rejections[reason] += 1
        self.failed[name] = f"rejected {reason}: {detail}"


def site_metrics(reply: Reply) -> dict:
    """The per-site part of the round's metrics line, from a train reply."""
    st = reply.status
    m = dict(reply.message.content.metric_records.get(keys.METRICS, {}))
    try:
        samples: int | None = num_examples(st)
    except StatusError:  # a figure of the line, not a reason to drop an update the round already took
        samples = None
    out = {"loss": m.get("loss"), "samples": samples, "seconds": m.get("train_s"),
           "relay_s": m.get("relay_s"), "rank_digests": list(st.get("rank_digests", []))}
    for key in ("upload_bytes", "dense_bytes", "encode_s", "state_arrays_in", "train_call_s", "evaluate_call_s",
                "bulk_up_bytes", "bulk_up_s", "bulk_down_bytes", "bulk_down_s", "bulk_retries", "bulk_fallback",
                # the trainer's ranks since its previous reply (site_trainer/overlap.py): idle share, background steps
                "idle_s", "idle_fraction", "background_steps", "background_s", "overlap_discarded_steps",
                "local_steps"):
        if key in m:
            out[key] = m[key]
    out.update({k: v for k, v in m.items() if k.startswith("dp_")})  # sites[].privacy: epsilon spent, sigma, ...
    pii = counts_from_metrics(m)  # the site's PII findings per entity type: counts only
    if pii:
        out["pii"] = pii
    return out
