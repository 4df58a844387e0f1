"""An in-process federation: the real Coordinator and the real ClientApp, joined by a real Grid.

`InProcessGrid` implements Flower's `Grid` (the same interface the ServerApp gets from the
SuperLink) by handing each message to an `InProcessSite`: one SuperNode's view, which runs the
real ClientApp with its mods on a fresh `Context` rebuilt from protobuf (as a new `flwr-clientapp`
process sees what the SuperNode kept). Messages and replies go through Flower's protobuf
serialization on the way, so what works here is what travels. Only the trainer differs from a
deployment: a site plugs in any `Trainer` (site/trainer_call.py), e.g. a numpy model trained in
this process. Used by benchmarks/_fedsim.py (simulations, the compression benchmark) and tests;
no copy of round logic lives here.

Replies are made when a message is pushed, so a stage costs no polling; a site that does not
answer (its handler returns None) hits the stage's deadline as over a real SuperLink.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.supercore.run import Run
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from federation.site.client_app import build_client_app
from federation.protocol.codecs import Arrays
from federation.protocol.round_config import RoundConfig
from federation.site.site_env import SiteEnv
from federation.site.trainer_call import EvalResult, GlobalModel, Trainer, TrainerFailed, TrainResult
from site_trainer import handoff

SUPERLINK_NODE_ID = 1  # the node id the ServerApp's messages come from


def wire(msg: Message) -> Message:
    """`msg` as the receiver gets it: through Flower's protobuf form (the metadata kept as set)."""
    return message_from_proto(message_to_proto(msg))


class InProcessSite:
    """One site: a SuperNode's node config and context state, and the real ClientApp."""

    def __init__(self, name: str, node_id: int, trainer: Trainer, node_config: dict | None = None, run_id: int = 1):
        self.name, self.node_id, self.trainer = name, node_id, trainer
        self.app = build_client_app(self._trainer_for)
        self.context = context_to_proto(Context(run_id=run_id, node_id=node_id,
                                                node_config={"site-id": name, **(node_config or {})},
                                                state=RecordDict(), run_config={}))

    def _trainer_for(self, env: SiteEnv) -> Trainer:
        return self.trainer

    def handle(self, msg: Message) -> Message | None:
        """The reply a fresh ClientApp process would push (an exception becomes Flower's error reply)."""
        ctx = context_from_proto(self.context)
        try:
            reply = self.app(msg, ctx)
        except Exception as err:  # what flwr's run_clientapp does with an exception
            reply = Message(Error(code=0, reason=f"{type(err)}:<'{err}'>"), reply_to=msg)
        self.context = context_to_proto(ctx)
        return reply


class InProcessGrid(Grid):
    """Flower's `Grid`, delivering each message to an `InProcessSite` in this process."""

    def __init__(self, sites: Iterable[InProcessSite], run_id: int = 1):
        self.sites = {s.node_id: s for s in sites}
        self._run = Run.create_empty(run_id)
        self.replies: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        """The run this grid serves."""
        self._run = run

    @property
    def run(self) -> Run:
        """The run this grid serves."""
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        """A message to one site (Flower's signature; the driver builds its own)."""
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        """The sites' node ids."""
        return list(self.sites)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Deliver each message (serialized) and keep the (serialized) reply to be pulled."""
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            site = self.sites.get(msg.metadata.dst_node_id)
            if site is None:
                ids.append("")  # as the SuperLink refuses a message to an unknown node
                continue
            reply = site.handle(wire(msg))
            if reply is not None:
                reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                self.replies[mid] = wire(reply)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """The replies to these messages that arrived (each is handed out once)."""
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Push, then pull every reply there is (replies are made at push time)."""
        return self.pull_messages(self.push_messages(messages))


@contextmanager
def task_identity(run_id: int) -> Iterator[None]:
    """Flower's task identity for messages created in this process (the ServerApp's, as flwr sets it
    in a ServerApp process), restored afterwards."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SUPERLINK_NODE_ID, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class FunctionTrainer:
    """A `Trainer` from plain functions, for simulations: `train(model, config) -> (update, metrics)`
    on numpy arrays, with the site's example count and a workdir for its store. `handoff_update`:
    return the update as the trainer service does, in a hand-off file (the ClientApp streams it).
    `step_s_estimate`: the seconds per local step it declares at discovery, as the site trainer
    times one at its start (round_target_s plans round 1 with it). `holds`: the model it starts
    from, shown at discovery (`export`), as the site trainer shows the model it built."""

    def __init__(self, train: Callable[[Arrays, RoundConfig], tuple[Arrays, dict]], num_examples: int,
                 workdir: str | Path, evaluate: Callable[[Arrays, RoundConfig], dict] | None = None,
                 handoff_update: bool = False, step_s_estimate: float | None = None, holds: Arrays | None = None):
        self._train, self._evaluate, self.handoff_update = train, evaluate, handoff_update
        self.num_examples, self._workdir = int(num_examples), Path(workdir)
        self.step_s_estimate = step_s_estimate
        self.holds = holds

    def info(self) -> dict:
        """Discovery: the example count, one rank (and the declared step time, if any)."""
        out = {"num_examples": self.num_examples, "ranks": 1, "workdir": str(self._workdir)}
        return out | ({"step_s_estimate": self.step_s_estimate} if self.step_s_estimate else {})

    def workdir(self) -> Path:
        """Where this site's store lives."""
        return self._workdir

    def export(self, timeout_s: float) -> handoff.Handle | None:  # noqa: ARG002 - nothing to wait for
        """The model it starts from (`holds`) in a hand-off file the caller unlinks; None without one."""
        return handoff.write_arrays(self.holds, tag="inprocess-export") if self.holds is not None else None

    def train(self, model: GlobalModel, config: RoundConfig) -> TrainResult:
        """Run the training function on the model's arrays."""
        update, metrics = self._train(model.arrays(), config)
        if not self.handoff_update:
            return TrainResult(update, self.num_examples, dict(metrics))
        handle = handoff.write_arrays(update, tag="inprocess-update")
        try:
            source = handoff.Reader(handle)
        finally:
            handoff.release(handle.path)
        return TrainResult({}, self.num_examples, dict(metrics), source=source)

    def evaluate(self, model: GlobalModel, config: RoundConfig) -> EvalResult:
        """Run the evaluation function on the model's arrays."""
        if self._evaluate is None:
            raise TrainerFailed("this simulated site has no evaluation function")
        return EvalResult(self.num_examples, dict(self._evaluate(model.arrays(), config)))
