"""The exchange: messages out to the sites and their replies back, over Flower's Grid.

`MessageExchange.exchange` pushes one message per node of a stage (with the records of what rides
on it, strategy.Rider) and pulls replies until all answered or the stage's deadline passed, naming
each site that crashed, erred or missed it and counting the bytes; `run` drives a round strategy's
stages through it. Riders may address sites the stage does not: those side queries go out with
the stage but are not waited for; `await_side_queries` (before the next round: wait for the queries to its
sites) and `drop_side_queries` (give up on the rest) end them.

What lies beneath the exchange is the grid's: the data path, which moves a message's large Arrays
beside it and puts a reply's back before the exchange reads it, the SuperLink's retries
(retry_grid.py) and, around Flower's own Grid, the pack of a message's small records into one
Flower object (pack_grid.py). A reply the grid refuses comes back marked (refused_reply.py) and
fails its site. A grid that holds things for a stage is told when they can go: `stage_over` once the stage's messages are
answered or expired, `replies_folded` once its replies are aggregated (`tell_grid`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from flwr.app import ConfigRecord, Message, RecordDict

from federation.coordinator.downlink_sender import DownlinkSender
from federation.coordinator.polling import PollSchedule
from federation.coordinator.refused_reply import refusal
from federation.coordinator.reply_folds import Folds
from federation.coordinator.strategy import Exchange, ExchangeResult, Reply, Rider, Strategy
from federation.protocol import message_cost
from federation.protocol import message_keys as keys
from federation.protocol import testing_hooks
from federation.protocol.payload_records import record_bytes, sent_bytes

O = TypeVar("O")


@dataclass
class Traffic:
    """Array bytes a strategy's stages sent and received (good replies only), and their timings."""

    down: int = 0
    up: int = 0
    stages: list[dict] = field(default_factory=list)


def stage_timing(name: str, result: ExchangeResult, aggregate_s: float = 0.0) -> dict:
    """One stage's line in the metrics' `timing.stages`."""
    line = {"stage": name, "seconds": round(result.seconds, 4), "push_s": round(result.push_s, 4),
            "wait_s": round(result.wait_s, 4), "receive_s": round(result.receive_s, 4),
            "aggregate_s": round(aggregate_s, 4), "replies": len(result.by_node),
            "slowest_reply_s": round(max(result.by_node.values(), default=0.0), 4),
            "messages": result.msg_cost}
    if result.receive_spans:  # a streamed stage: each site's fold (start, end after the push began), their sum
        line["receive_busy_s"] = round(result.receive_busy_s, 4)
        line["receive_spans"] = {k: [round(a, 4), round(b, 4)] for k, (a, b) in sorted(result.receive_spans.items())}
    return line


class MessageExchange:
    """Pushes, pulls until the deadline, checks replies; counts the messages sent per node.

    `site_name(node)`: the name a node goes by (node-<id> before discovery); `known_name(node)`:
    that name, None before discovery; `reject(reason)` counts a refused reply run-wide."""

    def __init__(self, grid: Any, downlink: DownlinkSender, site_name: Callable[[int], str],
                 known_name: Callable[[int], str | None], reject: Callable[[str], None]):
        self.grid, self.downlink = grid, downlink
        self.site_name, self.known_name, self.reject = site_name, known_name, reject
        self.riders: list[Rider] = []  # riding on every message sent now
        # rider-only messages in flight: id -> (node, riders, the monotonic time its deadline passes)
        self.side: dict[str, tuple[int, list[Rider], float]] = {}
        self.messages: Counter[int] = Counter()  # messages sent per node over the run (round trips)

    def message(self, node: int, rd: RecordDict, message_type: str, deadline_s: float,
                riders: list[Rider]) -> tuple[Message, list[Rider]]:
        """The message to `node` with the riders' records, and the riders that are to see its reply
        (those that added records, and those that see every reply)."""
        seen = []
        for rider in riders:
            recs = rider.records(node)
            for key, rec in recs.items():
                rd[key] = rec
            if recs or getattr(rider, "sees_every_reply", False):
                seen.append(rider)
        self.messages[node] += 1
        return Message(rd, dst_node_id=node, message_type=message_type,
                       ttl=deadline_s + message_cost.TTL_MARGIN_S), seen

    def exchange(self, ex: Exchange, receive: Callable[[Reply], None] | None = None,
                 workers: int = 1) -> ExchangeResult:
        """Push one message per node (with the riders' records) and collect replies until all
        answered or the deadline; riders' own messages go out too but are not waited for.

        With `receive`, each good reply is handed over as soon as it is pulled and not kept
        (replies are pulled one at a time), so a stage of large replies holds at most `workers`
        of them: with more than one, `receive` runs on that many threads while the exchange goes
        on pulling (reply_folds.py); without `receive`, the good replies come back in the result."""
        result, t0 = ExchangeResult(), time.monotonic()
        riders = list(self.riders)
        built = [self.message(node, ex.content(node), ex.message_type, ex.deadline_s, riders) for node in ex.nodes]
        n_main = len(built)
        side = [n for n in dict.fromkeys(n for r in riders for n in r.wanted()) if n not in set(ex.nodes)]
        built += [self.message(n, RecordDict({keys.CONFIG: ConfigRecord({})}), "query", ex.deadline_s, riders)
                  for n in side]
        names = {m.metadata.dst_node_id: self.site_name(m.metadata.dst_node_id) for m, _ in built}
        pending: dict[str, tuple[int, list[Rider]]] = {}
        pushed = time.time()  # wall clock (the sites stamp replies on theirs): a site may start before the push ends
        ids = list(self.grid.push_messages([m for m, _ in built])) if built else []
        for m, _ in built:  # as pushed: the grid beneath may have moved large Arrays beside the message
            result.bytes_down += sent_bytes(m.content)
        for i, (mid, (m, seen)) in enumerate(zip(ids, built)):
            node = m.metadata.dst_node_id
            if not mid:
                for rider in seen:
                    rider.take(node, None)
                if i < n_main:
                    result.failed[names[node]] = "push_failed: the SuperLink did not accept the message"
            elif i < n_main:
                pending[mid] = (node, seen)
            else:
                self.side[mid] = (node, seen, t0 + ex.deadline_s)
        del built
        self.downlink.forget_stage()  # pushed: the serialized model lives on in the SuperLink or the data path's file
        result.push_s = time.monotonic() - t0
        end = time.monotonic() + ex.deadline_s
        poll = PollSchedule()  # (polling.py: how often a wait asks the SuperLink)
        folds = Folds(receive, workers, t0, result) if receive else None
        try:
            while pending and time.monotonic() < end:
                self.pull_side_replies()
                batches = [[mid] for mid in pending] if receive else [list(pending)]
                for batch in batches:
                    if folds is not None and not folds.room():
                        break  # every worker holds a reply: the others wait on the SuperLink until one is done
                    for reply in self.grid.pull_messages(batch):
                        entry = pending.pop(reply.metadata.reply_to_message_id, None)
                        if entry is None:
                            continue
                        node, seen = entry
                        result.by_node[node] = time.monotonic() - t0
                        if reply.has_content():
                            result.msg_cost[names[node]] = message_cost.split(reply.content, pushed, time.time())
                        refused = refusal(reply)
                        if refused is not None:  # the grid beneath could not hand it on as the site sent it
                            result.failed[names[node]] = f"{refused.reason}: {refused.detail}"
                            self.reject(refused.reason)
                            for rider in seen:
                                rider.take(node, None)
                            continue
                        for rider in seen:
                            rider.take(node, reply)
                        good = self._check_reply(result, names[node], node, reply)
                        if good is not None:
                            if folds is not None:
                                folds.submit(good)
                            else:
                                result.replies.append(good)
                        reply = good = None  # streamed: drop this reply before the next pull
                if pending:
                    wait_s = max(0.0, min(poll.next_wait(), end - time.monotonic()))
                    if folds is not None:
                        folds.wait(wait_s)  # woken early when a fold ends: its slot can take the next reply
                    else:
                        time.sleep(wait_s)
        except BaseException:
            if folds is not None:
                folds.close(raise_errors=False)  # no fold left running on the strategy's state
            raise
        if folds is not None:
            folds.close()  # every fold done before the stage's aggregate (a fold's error is raised here)
        self.pull_side_replies()
        self.tell_grid("stage_over")
        for node, seen in pending.values():
            result.failed[names[node]] = f"deadline: no reply within {ex.deadline_s:.0f}s (crashed, hung or disconnected)"
            for rider in seen:
                rider.take(node, None)
        result.seconds = time.monotonic() - t0
        result.wait_s = max(0.0, result.seconds - result.push_s - result.receive_s)
        return result

    def tell_grid(self, event: str) -> None:
        """Call the grid's `event` (`stage_over`, `replies_folded`) if it has one: a grid layer that
        holds things for a stage lets them go then; Flower's own Grid has neither."""
        hook = getattr(self.grid, event, None)
        if hook is not None:
            hook()

    def _check_reply(self, result: ExchangeResult, name: str, node: int, reply: Message) -> Reply | None:
        """A good reply, or None with the site's failure recorded in `result`."""
        if reply.has_error():
            reason = str(reply.error.reason)
            result.failed[name] = (f"deadline: the message expired before the site answered ({reason})"
                                   if "TTL" in reason else f"client_error: {reason}")
            return None
        status = reply.content.config_records.get(keys.STATUS)
        if status is None or not status.get("ok", False):
            result.failed[name] = f"site_error: {status.get('error') if status else 'no status in reply'}"
            return None
        self.downlink.heard(node, status)
        result.bytes_up += record_bytes(reply.content)
        return Reply(name, node, reply)

    # ---- side queries: riders' messages to sites the stage does not address ----------------------
    def pull_side_replies(self) -> bool:
        """Hand the riders' replies that arrived to them; whether any did."""
        if not self.side:
            return False
        got = False
        for reply in self.grid.pull_messages(list(self.side)):
            entry = self.side.pop(reply.metadata.reply_to_message_id, None)
            if entry is not None:
                got = True
                node, riders, _ = entry
                for rider in riders:
                    rider.take(node, reply)
        return got

    def drop_side_queries(self) -> None:
        """Give up on the side queries: take what arrived of them, tell their riders the rest never
        will (a round never waits for a site it does not address)."""
        self.pull_side_replies()
        for node, riders, _ in self.side.values():
            for rider in riders:
                rider.take(node, None)
        self.side.clear()

    def await_all_side_queries(self, deadline_s: float) -> None:
        """Wait for every side query until it is answered or `deadline_s` from now, then `drop_side_queries`."""
        deadline, poll = time.monotonic() + deadline_s, PollSchedule()
        while self.side and time.monotonic() < deadline:
            if not self.pull_side_replies():
                time.sleep(max(0.0, min(poll.next_wait(), deadline - time.monotonic())))
        self.drop_side_queries()

    def await_side_queries(self, nodes: list[int]) -> None:
        """Before a round: wait for what the last round asked `nodes` on the side (a site that missed
        a stage was sent a query for this round's setup) until each answers or its own deadline
        passes, then `drop_side_queries`. Giving up sooner would make a slow but live site sit this round out
        only because the last round's final stage was quicker than its ClientApp; a dead site costs
        at most what is left of its query's deadline."""
        mine = set(nodes)
        poll = PollSchedule()
        while True:
            ends = [end for node, _, end in self.side.values() if node in mine]
            left = max(ends) - time.monotonic() if ends else 0.0
            if left <= 0:
                break
            if not self.pull_side_replies():
                time.sleep(max(0.0, min(poll.next_wait(), left)))
        self.drop_side_queries()

    # ---- a strategy's stages -------------------------------------------------------------------
    def run(self, strategy: Strategy[object, O], state: object, workers: int,
            before_aggregate: Callable[[], None], after_stage: Callable[[], None]) -> tuple[O, Traffic]:
        """Run a strategy's stages (exchange, then the strategy's aggregate of the stage's result),
        then its `finish` (or `abort`). `workers`: the reply folds of a concurrent stage;
        `before_aggregate` runs before each stage's aggregate, `after_stage` after it."""
        traffic = Traffic()
        try:
            for step in strategy.steps():
                ex = step.configure(state)
                if ex is None:
                    continue
                testing_hooks.stage_entered(ex.stage, state)  # inert unless a test sets SOVFL_TEST_STAGE_HOOK
                result = self.exchange(ex, partial(step.receive, state) if step.receive else None,
                                       workers if step.concurrent else 1)
                traffic.down += result.bytes_down
                traffic.up += result.bytes_up
                before_aggregate()
                t0 = time.monotonic()
                step.aggregate(state, result)
                self.tell_grid("replies_folded")
                traffic.stages.append(stage_timing(ex.stage, result, time.monotonic() - t0))
                after_stage()
            testing_hooks.stage_entered("aggregate", state)
            t0 = time.monotonic()
            out = strategy.finish(state)
            took = round(time.monotonic() - t0, 4)  # the strategy's own work (decode, unmask): aggregation
            traffic.stages.append({"stage": "finish", "seconds": took, "push_s": 0.0, "wait_s": 0.0, "receive_s": 0.0,
                                   "aggregate_s": took, "replies": 0, "slowest_reply_s": 0.0})
            return out, traffic
        except strategy.aborts as err:
            return strategy.abort(state, err), traffic
