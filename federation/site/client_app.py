"""The ClientApp: a thin relay between Flower and the site's trainer service.

Flower starts one process per message, so nothing here is long-lived and torch is never
imported: the global model is handed to trainer rank 0 through shared memory, the update comes
back the same way, goes through the site's pipeline (codec → protection) and onto the wire.
Every failure becomes a reply that names the site and says what went wrong.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from crypto.pki import SiteBundle
from federation.site import attestation_mod as site_attestation
from federation.protocol.update_codec import CodecStage
from federation.protocol.codecs import CodecStateError
from federation.protocol.downlink_steps import DownlinkError
from federation.site.downlink_mod import receive_global, trainer_workdir
from federation.protocol.pipeline import Payload, Pipeline, RoundContext
from federation.protocol.envelope_stage import SiteProtection
from federation.protocol.payload_records import to_records
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


def _bundle(context: Context) -> SiteBundle | None:
    """The site's provisioned keys, when its SuperNode was started with `bundle-dir`."""
    path = str(context.node_config.get("bundle-dir", ""))
    return SiteBundle.load(path) if path else None


def _status(site: str, ok: bool, error: str = "", **extra) -> ConfigRecord:
    return ConfigRecord({"site": site, "ok": ok, "error": error, **extra})


def _fail(msg: Message, site: str, error: str) -> Message:
    return Message(RecordDict({"status": _status(site, False, error)}), reply_to=msg)


def _take_state(reply: dict) -> dict[str, np.ndarray]:
    if not reply.get("state"):
        return {}
    h = handoff.Handle.from_json(reply["state"])
    try:
        return {k: np.array(v) for k, v in handoff.map_arrays(h).items()}
    finally:
        handoff.release(h.path)


def encode_update(arrays: dict[str, np.ndarray], state: dict[str, np.ndarray], cfg: ConfigRecord,
                  ctx: RoundContext, bundle: SiteBundle | None = None, site_seed: int | None = None
                  ) -> tuple[Payload, dict[str, np.ndarray] | None, dict[str, float]]:
    """Run the site's pipeline (codec, then protection: sign, and seal if the round asks) on an
    update. Without a `bundle` the update leaves unsigned (a coordinator with a PKI rejects it).
    `site_seed` makes stochastic rounding reproducible (simulations); None draws OS entropy.

    Returns the wire payload, the codec state to keep for the next round (None: unchanged) and
    metrics for the round's line.
    """
    spec = str(cfg.get("codec", "identity"))
    stages, codec = [], None
    if spec != "identity":
        codec = CodecStage.from_spec(spec, bool(cfg.get("error_feedback", True)), state=state, site_seed=site_seed)
        stages.append(codec)
    if bundle is not None:
        stages.append(SiteProtection(bundle, seal=bool(cfg.get("seal", False))))
    try:
        payload = Pipeline(tuple(stages)).encode(Payload(arrays), ctx)
    except CodecStateError:  # the model changed shape since the residual was kept: start afresh
        codec.state = {}
        payload = Pipeline(tuple(stages)).encode(Payload(arrays), ctx)
    metrics = {"upload_bytes": float(payload.nbytes), "dense_bytes": float(sum(a.nbytes for a in arrays.values()))}
    if codec is not None:
        metrics["encode_s"] = codec.encode_s
    return payload, (codec.new_state if codec else None), metrics


@app.query()
def query(msg: Message, context: Context) -> Message:
    site, sock = _site(context)
    if "attest" in msg.content.config_records:  # attested admission, both directions
        return site_attestation.on_query(msg, context, site, _bundle(context))
    if "secagg" in msg.content.config_records:  # secure-aggregation stages 1, 2 and 4
        from federation.site import secagg_mod as secagg_site

        return secagg_site.on_query(msg, context, site)
    try:
        info = endpoint.call(sock, "Info", {}, timeout_s=30)
    except (endpoint.TrainerUnavailable, endpoint.TrainerError) as err:
        return _fail(msg, site, str(err))
    return Message(RecordDict({"status": _status(site, True, num_examples=info["num_examples"], ranks=info["ranks"])}),
                   reply_to=msg)


def _relay(msg: Message, context: Context, method: str) -> Message:
    site, sock = _site(context)
    cfg = msg.content.config_records.get("config", ConfigRecord())
    if method == "Train":  # a site that verifies the coordinator releases nothing to an unattested one
        try:
            why = site_attestation.refusal(context, _bundle(context))
        except site_attestation.SiteAttestationError as err:
            why = str(err)
        if why:
            return _fail(msg, site, why)
    deadline = float(cfg.get("deadline_s", 300))
    with_state = method == "Train" and str(cfg.get("codec", "identity")) != "identity" and bool(cfg.get("error_feedback", True))
    t0 = time.perf_counter()
    try:  # the dense model, or rebuilt from the model this site holds (downlink codec)
        glob = receive_global(msg.content, site, lambda: trainer_workdir(sock))
    except DownlinkError as err:
        return _fail(msg, site, f"site {site}: {err}")
    try:
        reply = endpoint.call(sock, method, {
            "round": int(cfg.get("round", 0)), "global": glob.handle.to_json(), "config": dict(cfg),
            "timeout_s": deadline, "with_state": with_state,
        }, timeout_s=deadline)
    except (endpoint.TrainerUnavailable, endpoint.TrainerError) as err:
        return _fail(msg, site, str(err))
    finally:
        glob.release()
    metrics = {k: float(v) for k, v in reply.get("metrics", {}).items()}
    status = _status(site, True, num_examples=int(reply["num_examples"]),
                     rank_digests=[str(d) for d in reply.get("rank_digests", [])], **glob.status)
    out = RecordDict({"status": status})
    if method == "Train":
        upd = handoff.Handle.from_json(reply["update"])
        try:
            arrays = handoff.map_arrays(upd)  # views stay valid after the unlink below: no copy
        finally:
            handoff.release(upd.path)
        ctx = RoundContext(str(cfg.get("federation", "")), int(msg.metadata.run_id), int(cfg.get("round", 0)), site,
                           int(cfg.get("seed", 0)))
        state = _take_state(reply)
        secagg = "secagg" in msg.content.config_records  # masked, not enveloped: the sum is what opens
        payload, new_state, pipe_metrics = encode_update(arrays, state, cfg, ctx, None if secagg else _bundle(context))
        pipe_metrics["state_arrays_in"] = float(len(state))
        if new_state is not None:
            h = handoff.write_arrays(new_state, tag=f"{site}-state")
            try:
                endpoint.call(sock, "PutState", {"state": h.to_json()}, timeout_s=30)
            except (endpoint.TrainerUnavailable, endpoint.TrainerError) as err:
                return _fail(msg, site, f"could not keep the codec state for the next round: {err}")
            finally:
                handoff.release(h.path)
        if secagg:  # stage 3: the update leaves masked
            from federation.site import secagg_mod as secagg_site

            out = secagg_site.on_train(msg, context, site, payload, int(reply["num_examples"]))
        else:
            out = to_records(payload, "update", "update_meta")
        out["status"] = status
        metrics.update(pipe_metrics)
    metrics["relay_s"] = time.perf_counter() - t0
    out["metrics"] = MetricRecord(metrics)
    return Message(out, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _relay(msg, context, "Train")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _relay(msg, context, "Evaluate")
