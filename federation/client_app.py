"""The ClientApp: a thin relay between Flower and the site's trainer service.

Flower starts one process per message, so nothing here is long-lived and torch is never
imported: the global model is handed to trainer rank 0 through shared memory, the update comes
back the same way, goes through the site's pipeline (codec → protection) and onto the wire.
Every failure becomes a reply that names the site and says what went wrong.
"""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from federation.pipeline import Payload, Pipeline, RoundContext
from federation.wire import from_records, to_records
from site_trainer import endpoint, handoff

app = ClientApp()


def _site(context: Context) -> tuple[str, str]:
    cfg = context.node_config
    try:
        return str(cfg["site-id"]), str(cfg["trainer-socket"])
    except KeyError as err:
        raise RuntimeError(
            f"SuperNode started without node config {err}; start it with "
            "--node-config 'site-id=\"NAME\" trainer-socket=\"/path/to/trainer.sock\"'"
        ) from None


def _status(site: str, ok: bool, error: str = "", **extra) -> ConfigRecord:
    return ConfigRecord({"site": site, "ok": ok, "error": error, **extra})


def _fail(msg: Message, site: str, error: str) -> Message:
    return Message(RecordDict({"status": _status(site, False, error)}), reply_to=msg)


def site_pipeline(config: ConfigRecord) -> Pipeline:
    """The stages this site applies before an update leaves it (codecs and protection plug in here)."""
    return Pipeline()


@app.query()
def query(msg: Message, context: Context) -> Message:
    site, sock = _site(context)
    try:
        info = endpoint.call(sock, "Info", {}, timeout_s=30)
    except (endpoint.TrainerUnavailable, endpoint.TrainerError) as err:
        return _fail(msg, site, str(err))
    return Message(RecordDict({"status": _status(site, True, num_examples=info["num_examples"], ranks=info["ranks"])}),
                   reply_to=msg)


def _relay(msg: Message, context: Context, method: str) -> Message:
    site, sock = _site(context)
    cfg = msg.content.config_records.get("config", ConfigRecord())
    deadline = float(cfg.get("deadline_s", 300))
    t0 = time.perf_counter()
    glob = from_records(msg.content, "global")
    handle = handoff.write_arrays(glob.arrays, tag=f"{site}-global")
    try:
        reply = endpoint.call(sock, method, {
            "round": int(cfg.get("round", 0)), "global": handle.to_json(), "config": dict(cfg),
            "timeout_s": deadline,
        }, timeout_s=deadline)
    except (endpoint.TrainerUnavailable, endpoint.TrainerError) as err:
        return _fail(msg, site, str(err))
    finally:
        handoff.release(handle.path)
    metrics = {k: float(v) for k, v in reply.get("metrics", {}).items()}
    status = _status(site, True, num_examples=int(reply["num_examples"]),
                     rank_digests=[str(d) for d in reply.get("rank_digests", [])])
    out = RecordDict({"status": status})
    if method == "Train":
        upd = handoff.Handle.from_json(reply["update"])
        try:
            arrays = handoff.map_arrays(upd)  # views stay valid after the unlink below: no copy
        finally:
            handoff.release(upd.path)
        ctx = RoundContext(str(cfg.get("federation", "")), int(msg.metadata.run_id), int(cfg.get("round", 0)), site)
        payload = site_pipeline(cfg).encode(Payload(arrays), ctx)
        out = to_records(payload, "update", "update_meta")
        out["status"] = status
        metrics["upload_bytes"] = float(payload.nbytes)
    metrics["relay_s"] = time.perf_counter() - t0
    out["metrics"] = MetricRecord(metrics)
    return Message(out, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _relay(msg, context, "Train")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _relay(msg, context, "Evaluate")
