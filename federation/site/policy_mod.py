"""The site's policy, as a mod: every train message is held against the site's own rules
(site_trainer/policy_config.py, node config `site-policy`) before any training, and the trainer's
update against them before it leaves (federation/protocol/policy_check.py).

A round outside the policy gets a failure reply whose error starts with the rule's reason code
(`policy_<rule>: why`); the coordinator counts it as `policy:<code>` and the site stays in the run
for the rounds that comply. Under SecAgg+ the round's group is the one this site set the round up
with (the SecAgg plan's names, which its masks are shared with), not only what the TERMS record
says. What the site sent so far in the run (rounds, bytes) lives in Flower's per-run
`context.state`. Each decision is an entry of the site's audit log (audit_mod.py).
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MessageType

from crypto.pki.keys import cert_fingerprint, load_cert, public_key_fingerprint
from federation.protocol import message_keys as keys
from federation.protocol.site_terms import RoundTerms
from federation.site.attestation_mod import coordinator_trusted
from federation.protocol.policy_check import Identity, PolicyRefused, Usage, check_round, check_update
from federation.site.replies import fail, ok
from federation.site.site_env import SiteEnv, SitePolicyError, site_env
from site_trainer.policy_config import SitePolicy

STATE_KEY = "sovfl.policy"  # this mod's record in context.state: what the site sent in this run
SECAGG_STATE = "secagg"  # the SecAgg mod's record: `n<round>` holds the names of the round's plan


def identity(env: SiteEnv, policy: SitePolicy) -> Identity:
    """The federation as this site's bundle knows it, as far as `policy` asks (an empty Identity
    without a bundle): the CA-signed registry is read only for a peer list."""
    b = env.bundle
    if b is None:
        return Identity()
    keys_ = {name: public_key_fingerprint(rec.sign_public) for name, rec in b.trust().parties.items()
             if rec.role == "site"} if policy.peers is not None else {}
    return Identity(cert_fingerprint(load_cert(b.ca_cert)) if policy.federation_ca else None,
                    public_key_fingerprint(b.coordinator_sign_public), keys_)


def _usage(context: Context) -> Usage:
    rec = context.state.config_records.get(STATE_KEY)
    return Usage(int(rec.get("rounds", 0)), int(rec.get("bytes", 0))) if rec is not None else Usage()


def _group(context: Context, terms: RoundTerms) -> RoundTerms:
    """Under SecAgg+, the group this site's masks are shared with, as its own setup recorded it."""
    st = context.state.config_records.get(SECAGG_STATE)
    planned = st.get(f"n{terms.round}") if st is not None else None
    if not terms.secagg or not planned:
        return terms
    return RoundTerms(terms.run, terms.round, terms.rounds, terms.strategy, True,
                      sorted(set(terms.group) | {n for n in str(planned).split("\n") if n}))


def policy_mod(msg: Message, context: Context, call_next) -> Message:
    """Refuse a train message outside the site's policy before the trainer runs, and an update that
    breaks it before it leaves."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    env = site_env(context)
    try:
        policy = env.policy
    except SitePolicyError as err:
        return _refused(msg, env, PolicyRefused("policy_unreadable", str(err)), None)
    if policy is None:
        return call_next(msg, context)
    terms = RoundTerms.from_record(msg.content.config_records.get(keys.TERMS))
    if terms is not None:
        terms = _group(context, terms)
    usage = _usage(context)
    try:
        check_round(policy, env.site, env.config, terms, identity(env, policy), coordinator_trusted(context, env), usage)
    except PolicyRefused as err:
        return _refused(msg, env, err, terms)
    env.audit_events.append(("round_accepted", {"round": env.config.round, "group": terms.group if terms else [],
                                                "codec": env.config.codec, "update_kind": env.config.update_kind,
                                                "seal": env.config.seal, "secagg": bool(terms and terms.secagg),
                                                "strategy": terms.strategy if terms else ""}))
    reply = call_next(msg, context)
    if not ok(reply):
        return reply
    metrics = dict(reply.content.metric_records.get(keys.METRICS, {}))
    try:
        check_update(policy, metrics, usage)
    except PolicyRefused as err:
        refused = _refused(msg, env, err, terms)
        if keys.SECAGG_SETUP in reply.content.config_records:  # a coming round's setup, made once: keep it
            refused.content[keys.SECAGG_SETUP] = reply.content.config_records[keys.SECAGG_SETUP]
        return refused
    context.state[STATE_KEY] = ConfigRecord({"rounds": usage.rounds + 1,
                                             "bytes": usage.bytes + int(metrics.get("upload_bytes", 0))})
    return reply


def announcement(env: SiteEnv) -> dict[str, str]:
    """The discovery reply's POLICY field: the site's policy as JSON, when it announces it (the
    coordinator then plans rounds around it, coordinator/policy_forecast.py)."""
    try:
        policy = env.policy
    except SitePolicyError:
        return {}  # every round is refused until the file is fixed; nothing to announce
    if policy is None or not policy.announce:
        return {}
    return {keys.POLICY: policy.model_dump_json()}


def _refused(msg: Message, env: SiteEnv, err: PolicyRefused, terms: RoundTerms | None) -> Message:
    env.audit_events.append(("round_refused", {"round": env.config.round, "code": err.code, "why": err.detail,
                                               "group": terms.group if terms else []}))
    print(f"[sovfl site] site {env.site}: round {env.config.round} refused by its policy: {err}", flush=True)
    return fail(msg, env.site, str(err))
