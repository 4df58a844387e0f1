"""The site's audit log, as a mod (crypto/audit): what the site agreed to and refused, the digest
of each update it sent and of each model it received, the privacy budget it spent, and the
coordinator's log heads it witnessed. Signed with the site's provisioned key, in the file node
config `audit-log` names (the site's workdir); off without it or without a bundle.

It sits just inside SiteScope, so it sees the message as it came and the reply as it leaves. The
policy mod's decisions come through `SiteEnv.audit_events`. Every reply carries the log's head
after this message's entries (STATUS `audit_index`, `audit_hash`), which the coordinator records;
the coordinator's own head comes in the AUDIT record of its messages, which this site records.
A log that cannot be written never fails the message: the reply says why in `audit_error`.
"""

from __future__ import annotations

from flwr.app import Context, Message, MessageType

from crypto.audit import AuditLog, AuditLogError
from crypto.pki.keys import cert_fingerprint, load_cert, public_key_fingerprint
from federation.protocol import message_keys as keys
from federation.protocol.site_terms import update_digest
from federation.site.replies import ok
from federation.site.site_env import SiteEnv, site_env


def open_log(env: SiteEnv) -> AuditLog | None:
    """The site's log (opened on first use), or None when node config names none or there is no bundle."""
    path = str(env.node_config.get("audit-log", "") or "")
    b = env.bundle
    if not path or b is None:
        return None
    return AuditLog(path, b.sign_key, env.site, "site", {
        "federation": b.federation_id, "ca_fingerprint": cert_fingerprint(load_cert(b.ca_cert)),
        "coordinator": b.coordinator_name, "coordinator_key": public_key_fingerprint(b.coordinator_sign_public)})


def _received(msg: Message, env: SiteEnv) -> list[tuple[str, dict]]:
    """The coordinator's head this message carries, witnessed."""
    rec = msg.content.config_records.get(keys.AUDIT)
    if rec is None or "hash" not in rec or env.bundle is None:
        return []
    return [("witness", {"party": env.bundle.coordinator_name, "index": int(rec.get("index", -1)),
                         "hash": str(rec["hash"])})]


def _sent(msg: Message, env: SiteEnv, reply: Message) -> list[tuple[str, dict]]:
    """A train reply: the model received and the update sent, or why none was."""
    run, rnd = int(msg.metadata.run_id), env.config.round
    if not ok(reply):
        status = reply.content.config_records.get(keys.STATUS) if reply.has_content() else None
        refused = any(kind == "round_refused" for kind, _ in env.audit_events)
        return [] if refused else [("round_failed", {"run": run, "round": rnd,
                                                     "why": str(status.get("error", "")) if status else "no reply"})]
    status = reply.content.config_records[keys.STATUS]
    metrics = dict(reply.content.metric_records.get(keys.METRICS, {}))
    out = []
    if status.get(keys.MODEL_DIGEST):
        out.append(("model_received", {"run": run, "round": rnd, "digest": str(status[keys.MODEL_DIGEST])}))
    privacy = {k: v for k, v in metrics.items() if k.startswith("dp_")}
    pii = {k: v for k, v in metrics.items() if k.startswith("pii_")}
    out.append(("update_sent", {"run": run, "round": rnd, "digest": update_digest(reply.content),
                                "bytes": int(metrics.get("upload_bytes", 0)), "codec": env.config.codec,
                                **({"privacy": privacy} if privacy else {}), **({"pii": pii} if pii else {})}))
    return out


def audit_mod(msg: Message, context: Context, call_next) -> Message:
    """Record this message's events in the site's log; the log's head on the reply."""
    env = site_env(context)
    try:
        log = open_log(env)
    except (AuditLogError, OSError, ValueError) as err:
        log, error = None, f"audit log: {err}"
    else:
        error = ""
    if log is None:
        reply = call_next(msg, context)
        if error and reply.has_content() and keys.STATUS in reply.content.config_records:
            reply.content.config_records[keys.STATUS]["audit_error"] = error
        return reply
    events = _received(msg, env)
    reply = call_next(msg, context)
    events += [(k, {"run": int(msg.metadata.run_id), **f}) for k, f in env.audit_events]
    try:
        if msg.metadata.message_type == MessageType.TRAIN:
            events += _sent(msg, env, reply)
        head = log.extend(events) if events else log.head()
    except (AuditLogError, OSError, TypeError, ValueError) as err:
        if reply.has_content() and keys.STATUS in reply.content.config_records:
            reply.content.config_records[keys.STATUS]["audit_error"] = f"audit log: {err}"
        return reply
    if reply.has_content() and keys.STATUS in reply.content.config_records:
        status = reply.content.config_records[keys.STATUS]
        status[keys.AUDIT_INDEX], status[keys.AUDIT_HASH] = head.index, head.hash
    return reply
