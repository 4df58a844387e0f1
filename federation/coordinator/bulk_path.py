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

import itertools
import logging
from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from federation.coordinator.bulk_server import BulkServer
from federation.protocol import message_keys as keys
from federation.protocol.bulk import (
    CHUNK,
    INLINE_MAX,
    REF_STYPE,
    Blob,
    BlobWriter,
    Ref,
    big_records,
    has_big,
    offload,
    refs,
    resolve,
)
from federation.protocol.payload_records import npy_parts

log = logging.getLogger("sovfl.bulk")
_written = itertools.count()


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

    def direct(self, site: str | None) -> bool:
        """Whether `site` gets its model on the data path."""
        return site is not None and self.paths.get(site) == "direct"

    def offer_arrays(self, arrays: Mapping[str, np.ndarray]) -> tuple[ArrayRecord, int] | None:
        """The ArrayRecord that carries `arrays` to a direct site, and the bytes it stands for: the
        record `outgoing` makes of `to_array`'s record (the same references, to the same blob),
        but the large arrays' .npy bytes are written into the offer file tensor by tensor, so
        the serialized model is never in memory whole beside the model while the round's messages
        are built. None if the file cannot be written
        (the caller serializes the arrays whole, as for a site reached through Flower)."""
        writer = BlobWriter(str(self.server.dir / f"offer-new-{next(_written)}"), CHUNK)
        entries: list[tuple[str, Array | tuple[str, tuple, int, int]]] = []
        offset = wire = 0
        try:
            for name in arrays:
                a, header, data = npy_parts(arrays[name])  # a WireView rounds one bf16 tensor here
                n = len(header) + len(data)
                wire += n
                if n >= self.inline_max:
                    writer.write(header)
                    writer.write(data)
                    entries.append((name, (str(a.dtype), tuple(a.shape), offset, n)))
                    offset += n
                else:
                    entries.append((name, Array(dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray",
                                                data=b"".join((header, data)))))
                del a, header, data
            blob = writer.finish()
        except OSError as err:  # a full or read-only disk
            writer.abort()
            log.warning("bulk data path: cannot write the model's offer file under %s (%s); serializing it whole",
                        self.server.dir, err)
            return None
        if not offset:  # nothing large: it stays in the message, as `outgoing` leaves it
            blob.close()
            return ArrayRecord(dict(entries)), wire
        root = self.server.offer(blob)
        out = {}
        for name, e in entries:
            if isinstance(e, Array):
                out[name] = e
            else:
                dtype, shape, at, n = e
                ref = Ref(root, blob.size, blob.chunk, at, n, "numpy.ndarray")
                out[name] = Array(dtype=dtype, shape=shape, stype=REF_STYPE, data=ref.encode())
        return ArrayRecord(out), wire

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
