"""The site's mod of the bulk data path (protocol/bulk.py): large Arrays travel beside Flower.

On the way in, a message whose large Arrays the coordinator sent as references (the model) gets
them back from the coordinator's data path before any other mod sees it. On the way out, the
large Arrays of the reply (the sealed update, the masked SecAgg chunks) are uploaded and replaced
by references; the signature or mask above this layer covers the bytes, so the coordinator checks
the same thing it checked when they came through Flower. A discovery reply says which path the
site can use (`data_path` in its status: `direct`, or `flower: <why>`): the coordinator sends the
model through Flower to a site that cannot reach its data path, and a site whose upload fails
within the deadline sends its update through Flower instead (slower, and said in the log).

Node config `data-address` (HOST:PORT of the coordinator's data path) and the site's bundle
(`bundle-dir`: its client certificate) switch it on; without them everything stays in Flower.
"""

from __future__ import annotations

import sys
import time
from functools import cached_property, partial

from flwr.app import Context, Message

from federation.protocol import message_keys as keys
from federation.protocol.bulk import INLINE_MAX, BulkRefused, has_big, offload, refs, resolve
from federation.protocol.round_config import RoundConfigError
from federation.site import link_probe
from federation.site.bulk_client import STREAMS, BulkClient, BulkUnavailable
from federation.site.carried import UploadFile, carried, carry
from federation.site.replies import fail
from federation.site.site_env import SiteEnv, site_env
from federation.site.update_stream import download_file

DEFAULT_DEADLINE_S = 120.0  # a message without a round config (discovery, queries)


def _say(line: str) -> None:
    print(f"[sovfl site] {line}", file=sys.stderr, flush=True)


class SiteBulk:
    """The data path as one message's site sees it."""

    def __init__(self, env: SiteEnv, msg: Message):
        self.env = env
        self.address = str(env.node_config.get("data-address", "") or "")
        told = msg.content.config_records.get(keys.BULK)  # the coordinator puts this site on the data path
        self.told = told is not None
        self.inline_max = _int(told, "inline_max", INLINE_MAX)
        self.streams = max(1, min(32, _int(told, "streams", STREAMS)))

    @cached_property
    def client(self) -> BulkClient | None:
        """The channel to the coordinator's data path, None if this site has none."""
        if not self.address or self.env.bundle is None:
            return None
        return BulkClient(self.address, self.env.bundle, streams=self.streams, progress=_say)

    def why_not(self) -> str | None:
        """Why this site cannot use the data path (None: it can, as far as its settings go)."""
        if not self.address:
            return "no data-address in the SuperNode's node config"
        if self.env.bundle is None:
            return "no provisioned bundle (bundle-dir): no client certificate"
        return None

    def deadline_s(self) -> float:
        """How long a transfer of this message may take: the round config's deadline."""
        try:
            return float(self.env.config.deadline_s)
        except RoundConfigError:
            return DEFAULT_DEADLINE_S

    def probe(self) -> str:
        """`direct` if the coordinator's data path answers us, else `flower: <why>`."""
        why = self.why_not()
        if why is None:
            try:
                self.client.ping(timeout_s=10)
                return "direct"
            except Exception as err:  # any failure means: use Flower
                why = f"the data path at {self.address} did not answer ({type(err).__name__}: {_detail(err)})"
        return f"flower: {why}"


def _int(rec, key: str, default: int) -> int:
    try:
        return int(rec[key]) if rec is not None and key in rec else default
    except (TypeError, ValueError, OverflowError):
        return default


def _round(msg: Message) -> int:
    """The round a probe belongs to (the PROBE record says; 0: discovery)."""
    return _int(msg.content.config_records.get(keys.PROBE), "round", 0)


def _detail(err: Exception) -> str:
    detail = err.details() if hasattr(err, "details") else str(err)
    return str(detail)[:200]


def bulk_mod(msg: Message, context: Context, call_next) -> Message:
    """Fetch referenced Arrays of `msg`; upload large Arrays of the reply."""
    env = site_env(context)
    bulk = SiteBulk(env, msg)
    t0, down = time.perf_counter(), 0
    try:
        if refs(msg.content):
            if bulk.client is None:
                return fail(msg, env.site, f"bulk_unreachable: the coordinator sent the model on its data path but "
                            f"{bulk.why_not()}; give the SuperNode node config data-address=HOST:PORT and bundle-dir")
            down = _download(bulk, msg)
    except (BulkRefused, BulkUnavailable) as err:
        _release(env)
        return fail(msg, env.site, f"{getattr(err, 'reason', 'bulk_unavailable')}: {err}")
    except OSError as err:  # /dev/shm full or unwritable
        _release(env)
        return fail(msg, env.site, f"bulk_unavailable: cannot keep the downloaded model in a file: {err}")
    down_s = time.perf_counter() - t0
    env.bulk_direct = bulk.told and bulk.client is not None
    if env.bulk_direct:
        env.report_evaluation = partial(_report, bulk, int(msg.metadata.run_id))
    try:
        reply = call_next(msg, context)
        if not reply.has_content():
            return reply
        st = reply.content.config_records.get(keys.STATUS)
        path = None
        if keys.DISCOVER in msg.content.config_records and st is not None:
            st["data_path"] = path = bulk.probe()
        if keys.PROBE in msg.content.config_records and st is not None:  # measure the link (link_probe.py)
            direct = path == "direct" if path is not None else bulk.told
            st.update(link_probe.answer(bulk.client if direct else None, msg.content.config_records[keys.PROBE],
                                        _round(msg), reply.content))
        figures = {}
        if down:
            figures.update(bulk_down_bytes=float(down), bulk_down_s=down_s)
        upload = carried(reply)
        if isinstance(upload, UploadFile) and upload.record_key in reply.content.array_records:
            figures.update(_upload_file(bulk, msg, reply, upload))
        if bulk.told and bulk.client is not None and has_big(reply.content, bulk.inline_max):
            figures.update(_upload(bulk, msg, reply))
        if figures and keys.METRICS in reply.content.metric_records:
            reply.content.metric_records[keys.METRICS].update(figures)
        return reply
    finally:
        _release(env)
        if bulk.__dict__.get("client") is not None:
            bulk.client.close()


def _download(bulk: SiteBulk, msg: Message) -> int:
    """Download every blob `msg` references into a /dev/shm file, a verified chunk at a time, and
    put views of the files in place of the references; the message carries where each Array lies
    (carried.py: the downlink mod hands that file to the trainer, update_stream.py)."""
    env, found, paths, places = bulk.env, refs(msg.content), {}, {}

    def fetch(ref) -> memoryview:
        dl = download_file(ref.size, lambda fd: bulk.client.download_into(ref, bulk.deadline_s(), fd))
        env.downloads.append(dl)
        paths[ref.root] = dl.path
        return dl.view

    down = resolve(msg.content, fetch)
    for root, entries in found.items():
        for rkey, akey, ref in entries:
            places.setdefault(rkey, {})[akey] = (paths[root], ref.offset)
    carry(msg, places)
    return down


def _report(bulk: SiteBulk, run: int, metrics: dict[str, float]) -> None:
    """The site's evaluation figures to the coordinator now, ahead of the reply that carries them
    after the local steps; a failure costs only the early word (said on stderr)."""
    figures = {k: float(metrics[k]) for k in ("eval_loss", "num_val_examples", "eval_accuracy") if k in metrics}
    try:
        bulk.client.report(run, bulk.env.config.round, figures)
    except Exception as err:  # noqa: BLE001 - best effort: the reply still carries the figures
        _say(f"evaluation not reported ahead of the reply ({type(err).__name__}: {_detail(err)})")


def _release(env: SiteEnv) -> None:
    """Delete this message's data-path files (views of downloads stay valid while mapped)."""
    for dl in env.downloads:
        dl.release()
    env.downloads = []
    for f in env.opened:
        f.close()
    env.opened = []


def _upload_file(bulk: SiteBulk, msg: Message, reply: Message, update: UploadFile) -> dict[str, float]:
    """Upload the update's file (sealed, or SecAgg's masked chunks; the reply references it
    already); when the data path cannot take it, its bytes go into the reply for Flower to carry,
    and the log says why."""
    t0 = time.perf_counter()
    why = None
    if not (bulk.told and bulk.client is not None):
        why = "this site is not on the data path"
    else:
        try:
            bulk.client.upload(update.blob, int(msg.metadata.run_id), bulk.env.config.round, bulk.deadline_s() * 0.7)
        except (BulkRefused, BulkUnavailable, RoundConfigError) as err:
            why = str(err)
    if why is not None:
        _say(f"site {bulk.env.site}: update NOT sent on the data path ({why}); sending it through Flower")
        reply.content[update.record_key] = update.inline_records()
        return {"bulk_fallback": 1.0}
    return {"bulk_up_bytes": float(update.blob.size), "bulk_up_s": time.perf_counter() - t0,
            "bulk_retries": float(bulk.client.retries)}


def _upload(bulk: SiteBulk, msg: Message, reply: Message) -> dict[str, float]:
    """Upload the reply's large Arrays and put references in their place; on failure the reply keeps
    them (Flower carries them) and the log says why."""
    t0 = time.perf_counter()
    made = offload(reply.content, bulk.inline_max)
    if made is None:
        return {}
    blob, with_refs = made
    try:
        rnd = bulk.env.config.round
        bulk.client.upload(blob, int(msg.metadata.run_id), rnd, bulk.deadline_s() * 0.7)
    except (BulkRefused, BulkUnavailable, RoundConfigError) as err:
        _say(f"site {bulk.env.site}: update NOT sent on the data path ({err}); sending it through Flower")
        return {"bulk_fallback": 1.0}
    for key in with_refs.array_records:
        reply.content[key] = with_refs[key]
    return {"bulk_up_bytes": float(blob.size), "bulk_up_s": time.perf_counter() - t0,
            "bulk_retries": float(bulk.client.retries)}
