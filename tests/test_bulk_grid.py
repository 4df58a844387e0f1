"""The data path beneath the Grid (federation/coordinator/bulk_grid.py), through the real exchange, the
real data-path server and a real site client (mutual TLS, provisioned certificates): a direct site's
message leaves with references and the exchange counts the bytes they stand for; a site reached
through Flower gets its Arrays whole; a reply's references are resolved from what its site uploaded,
and a reply naming a blob its site never uploaded fails that site by name (`bulk_missing`), counted
once, its riders told it got none; the stage's offers are withdrawn when it ends."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from crypto.pki import CoordinatorBundle, SiteBundle, provision
from federation.coordinator.bulk_grid import BulkGrid
from federation.coordinator.bulk_path import BulkPath
from federation.coordinator.bulk_server import BulkServer
from federation.coordinator.downlink_sender import DownlinkSender
from federation.coordinator.exchange import MessageExchange
from federation.coordinator.strategy import Exchange
from federation.ops.inprocess import task_identity
from federation.ops.supervisor import free_port
from federation.protocol import message_keys as keys
from federation.protocol.bulk import REF_STYPE, offload, refs
from federation.protocol.payload_records import record_bytes, to_array
from federation.site.bulk_client import BulkClient

NAMES = {1: "paris", 2: "berlin"}
RUN, ROUND = 3, 1


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    provision(root, list(NAMES.values()), hosts=("127.0.0.1", "localhost"))
    return root


class SiteGrid:
    """The SuperLink and the two sites' ClientApps, as far as the exchange sees them: each message
    answered at push with the reply `answer(node)` makes, pulled once."""

    def __init__(self, answer):
        self.answer, self.pushed, self.replies, self.offered_at_push = answer, [], {}, None
        self.offered = lambda: 0

    def push_messages(self, messages):
        ids = []
        self.offered_at_push = self.offered()
        for i, msg in enumerate(messages):
            mid = f"m{len(self.pushed)}"
            msg.metadata.__dict__["_message_id"] = mid
            self.pushed.append(msg)
            self.replies[mid] = Message(self.answer(msg.metadata.dst_node_id), reply_to=msg)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


class Seen:
    """A rider that sees every reply: what each node's reply was (None: none usable)."""

    sees_every_reply = True

    def __init__(self):
        self.took: dict[int, Message | None] = {}

    def records(self, node):
        return {}

    def wanted(self):
        return []

    def take(self, node, reply):
        self.took[node] = reply


def _update(seed: int) -> RecordDict:
    big = np.random.default_rng(seed).standard_normal((600, 700)).astype(np.float32)  # over the inline limit
    status = ConfigRecord({"ok": True})
    return RecordDict({keys.UPDATE: ArrayRecord({"w": to_array(big)}), keys.STATUS: status})


def test_the_grid_moves_large_arrays_and_refuses_a_reply_whose_blob_was_never_uploaded(tmp_path, pki):
    server = BulkServer(CoordinatorBundle.load(pki / "coordinator"), tmp_path / "coord",
                        f"127.0.0.1:{free_port()}").start()
    server.window(RUN, ROUND)
    try:
        path = BulkPath(server, lambda line: None)
        path.heard("paris", ConfigRecord({"data_path": "direct"}))
        path.heard("berlin", ConfigRecord({"data_path": "flower: test"}))
        # paris uploads its update and replies with references to it; berlin names a blob it never uploaded
        paris_blob, paris_reply = offload(_update(1))
        BulkClient(f"127.0.0.1:{server.port}", SiteBundle.load(pki / "sites" / "paris")).upload(
            paris_blob, RUN, ROUND, deadline_s=60)
        _, berlin_reply = offload(_update(2))
        grid = SiteGrid(lambda node: paris_reply if node == 1 else berlin_reply)
        grid.offered = lambda: len(server.offered)
        rejected: Counter[str] = Counter()
        exchange = MessageExchange(BulkGrid(grid, path, NAMES.__getitem__, NAMES.get), DownlinkSender(),
                                   NAMES.__getitem__, NAMES.get, lambda reason: rejected.update([reason]))
        model = np.random.default_rng(0).standard_normal((500, 800)).astype(np.float32)
        whole = RecordDict({keys.GLOBAL: ArrayRecord({"m": to_array(model)})})
        rider = Seen()
        exchange.riders = [rider]
        with task_identity(RUN):
            result = exchange.exchange(Exchange("train", "train", [1, 2], lambda node: RecordDict(dict(whole.items())),
                                                30.0))

        to_paris, to_berlin = grid.pushed
        ref = to_paris.content.array_records[keys.GLOBAL]["m"]
        assert ref.stype == REF_STYPE and keys.BULK in to_paris.content.config_records
        assert to_berlin.content.array_records[keys.GLOBAL]["m"].stype != REF_STYPE
        assert keys.BULK not in to_berlin.content.config_records
        assert grid.offered_at_push == 1 and not server.offered  # offered while the stage ran, withdrawn after
        (entry,), = refs(to_paris.content).values()
        assert result.bytes_down == 2 * record_bytes(whole) + len(ref.data)  # the model's bytes to each, the ref's own
        assert entry[2].length == record_bytes(whole)

        assert [r.name for r in result.replies] == ["paris"]
        got = result.replies[0].message.content.array_records[keys.UPDATE]["w"]
        assert got.stype != REF_STYPE and bytes(got.data) == bytes(_update(1).array_records[keys.UPDATE]["w"].data)
        assert result.failed["berlin"].startswith("bulk_missing: site berlin uploaded no blob")
        assert rejected == Counter({"bulk_missing": 1})
        assert rider.took[2] is None and rider.took[1] is not None
    finally:
        server.stop()
