"""The driver's use of the bulk data path (protocol/bulk.py, bulk_server.py): which messages' large
Arrays leave Flower, and how replies get theirs back.

Outgoing: a message to a site that said at discovery that it reaches the data path (`data_path:
direct`) carries references instead of its large Arrays, which the server offers until the stage
ends; messages of one stage share their model, so its blob is hashed once per stage. A site that
cannot reach the data path gets its Arrays through Flower, and the log says so once.
Incoming: a reply's references are resolved from what that same site uploaded for this round, as
read-only maps of the verified files; a reference to anything else (another site's blob, a
truncated or never-finished upload) refuses the reply by name (`bulk_<code>`), and the round goes
on with the others.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import ConfigRecord, Message, RecordDict

from federation.coordinator.bulk_server import BulkServer
from federation.protocol import message_keys as keys
from federation.protocol.bulk import INLINE_MAX, Blob, BulkRefused, big_records, has_big, offload, refs, resolve


def ref_bytes(rd: RecordDict) -> int:
    """Bytes the references of `rd` stand for (what the data path moves for this message)."""
    try:
        return sum(r.length for entries in refs(rd).values() for _, _, r in entries)
    except BulkRefused:
        return 0


class BulkPath:
    """Per run: the server, and which sites use it."""

    def __init__(self, server: BulkServer, progress: Callable[[str], None], inline_max: int = INLINE_MAX,
                 streams: int = 4):
        self.server, self.progress, self.inline_max = server, progress, inline_max
        self.settings = ConfigRecord({"inline_max": inline_max, "streams": streams})  # what the sites are told
        self.paths: dict[str, str] = {}  # site -> "direct" or "flower: <why>" (from its discovery reply)
        self._stage: dict[tuple, tuple[Blob, RecordDict]] = {}

    def heard(self, site: str, status: ConfigRecord) -> None:
        """A discovery reply: which path `site` uses from now on."""
        path = str(status.get("data_path", "") or "flower: the site does not use the data path (older site?)")
        if self.paths.get(site) != path:
            self.paths[site] = path
            how = (f"direct, on the data path {self.server.address}" if path == "direct"
                   else f"through Flower ({path.removeprefix('flower: ')})")
            self.progress(f"site {site}: model and updates travel {how}")

    def outgoing(self, site: str | None, rd: RecordDict) -> RecordDict:
        """`rd` as it goes to `site`: its large Arrays as references if the site is direct."""
        if site is None or self.paths.get(site) != "direct":
            return rd
        if not has_big(rd, self.inline_max):
            return RecordDict({**dict(rd.items()), keys.BULK: self.settings})
        recs = big_records(rd, self.inline_max)  # the model's records: the same objects in every message of a stage
        key = tuple((rk, ak, id(a.data)) for rk, rec in recs.items() for ak, a in rec.items())
        made = self._stage.get(key)
        if made is None:
            made = offload(RecordDict(recs), self.inline_max)
            if made is None:
                return rd
            self.server.offer(made[0])
            self._stage[key] = made
        return RecordDict({**{k: made[1][k] if k in recs else v for k, v in rd.items()}, keys.BULK: self.settings})

    def stage_over(self) -> None:
        """The stage's messages are answered or expired: stop serving their model."""
        self._stage.clear()
        self.server.withdraw()

    def incoming(self, site: str, reply: Message) -> None:
        """Resolve the reply's references from what `site` uploaded (BulkRefused)."""
        if reply.has_error() or not reply.has_content():
            return
        found = refs(reply.content)
        if found:
            resolve(reply.content, lambda ref: self.server.take(site, ref.root, ref.size, ref.chunk))
