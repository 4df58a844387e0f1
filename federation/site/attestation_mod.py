"""The site's half of attested rounds, as a mod (torch-free, one ClientApp process per message).

Two steps, both driven by the coordinator's query messages carrying an ATTEST record:

1. ``evidence``: the coordinator sends a nonce it made; the site answers with evidence from its
   attester, bound to that nonce and to the site's Ed25519 update key, and, when it verifies the
   coordinator, a nonce of its own (kept in Flower's per-run `context.state`).
2. ``coordinator``: the coordinator answers that nonce with evidence bound to its X25519 sealing
   key; the site appraises it with its own verifiers and policy and records until when the
   coordinator is trusted.

Before any update leaves (a train message), `refusal` says whether the coordinator is currently
trusted; if not, the mod answers with the reason and the trainer is never called. The site's
settings come from its own file (node config ``attestation-config``), never from the coordinator.
"""

from __future__ import annotations

import base64
import hmac
import os
import time

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from crypto.attestation import AttestationError, Evidence, appraise, create_attester, create_verifier
from crypto.attestation.models import b64url, unb64url
from crypto.pki.keys import raw_public
from federation.config import SiteAttestation
from federation.protocol import message_keys as keys
from federation.site.replies import fail, status
from federation.site.site_env import SiteAttestationError, SiteEnv, site_env

STATE_KEY = "sovfl.attestation"  # this mod's record in context.state
NONCE_TTL_S = 300.0  # the coordinator answers our nonce in its very next exchange


def _state(context: Context) -> dict:
    rec = context.state.config_records.get(STATE_KEY)
    return dict(rec) if rec is not None else {}


def _save(context: Context, state: dict) -> None:
    context.state[STATE_KEY] = ConfigRecord(state)


def _reply(msg: Message, site: str, **extra) -> Message:
    return Message(RecordDict({keys.STATUS: status(site, True, **extra)}), reply_to=msg)


def attestation_mod(msg: Message, context: Context, call_next) -> Message:
    """Answer attestation queries; refuse a train message while the coordinator is not trusted."""
    kind = msg.metadata.message_type
    if kind == MessageType.QUERY and keys.ATTEST in msg.content.config_records:
        return answer(msg, context, site_env(context))
    if kind == MessageType.TRAIN:
        env = site_env(context)
        try:
            why = refusal(context, env)
        except SiteAttestationError as err:
            why = str(err)
        if why:
            return fail(msg, env.site, why)
    return call_next(msg, context)


def answer(msg: Message, context: Context, env: SiteEnv) -> Message:
    """Answer one attestation step; every failure is a reply that says why."""
    req = msg.content.config_records[keys.ATTEST]
    try:
        settings = env.attestation
        if settings is None:
            raise SiteAttestationError("the coordinator asks for attestation but this site has none configured; "
                                       "start its SuperNode with node config attestation-config=FILE")
        if env.bundle is None:
            raise SiteAttestationError("attestation binds the site's signing key: start the SuperNode with bundle-dir")
        step = str(req.get("step", ""))
        if step == "evidence":
            return _evidence(msg, context, env, settings, unb64url(str(req["nonce"])))
        if step == "coordinator":
            return _appraise_coordinator(msg, context, env, settings, str(req["evidence"]))
        raise SiteAttestationError(f"unknown attestation step {step!r}")
    except (SiteAttestationError, AttestationError, KeyError, ValueError) as err:
        return fail(msg, env.site, f"attestation: {err}")


def _evidence(msg: Message, context: Context, env: SiteEnv, settings: SiteAttestation, nonce: bytes) -> Message:
    assert settings.attester is not None  # SiteAttestation validates it
    attester = create_attester(settings.attester.kind, env.site, settings.attester.config)
    evidence = attester.attest(nonce, raw_public(env.bundle.sign_key.public_key()))
    extra = {"evidence": evidence.model_dump_json()}
    if settings.verify_coordinator:
        ours = os.urandom(32)
        state = _state(context)
        state.update(nonce=b64url(ours), nonce_expires=time.time() + NONCE_TTL_S)
        _save(context, state)
        extra["challenge"] = b64url(ours)
    return _reply(msg, env.site, **extra)


def _appraise_coordinator(msg: Message, context: Context, env: SiteEnv, settings: SiteAttestation,
                          evidence_json: str) -> Message:
    bundle = env.bundle
    state = _state(context)
    expected, expires = str(state.pop("nonce", "")), float(state.pop("nonce_expires", 0.0))
    _save(context, state)  # our nonce is spent whatever happens next
    if not expected or time.time() > expires:
        raise SiteAttestationError("nonce_mismatch: no fresh challenge of ours is outstanding for the coordinator")
    evidence = Evidence.model_validate_json(evidence_json)
    if evidence.attester != bundle.coordinator_name:
        raise SiteAttestationError(f"evidence names {evidence.attester!r}, not our coordinator "
                                   f"{bundle.coordinator_name!r}")
    if not hmac.compare_digest(evidence.nonce, expected):
        raise SiteAttestationError("nonce_mismatch: the coordinator's evidence answers another challenge")
    policy = settings.coordinator.policy
    verifiers = {name: create_verifier(name, cfg, allow_insecure_dev=policy.allow_insecure_dev)
                 for name, cfg in settings.coordinator.verifiers.items()}
    seal_key = raw_public(bundle.coordinator_seal_public)  # what the evidence must bind: the key we seal to
    result = appraise(evidence, nonce=unb64url(expected), public_key=seal_key, verifiers=verifiers, policy=policy)
    until = result.expires_at.timestamp()
    state.update(trusted_until=until, trusted_key=base64.b64encode(seal_key).decode())
    _save(context, state)
    return _reply(msg, env.site, trusted_until=until)


def refusal(context: Context, env: SiteEnv) -> str | None:
    """Why this site must not release an update now, or None. Only sites that verify the
    coordinator refuse; the check is against the site's own record of its appraisal."""
    settings = env.attestation
    if settings is None or not settings.verify_coordinator:
        return None
    state = _state(context)
    until = float(state.get("trusted_until", 0.0))
    if until <= time.time():
        why = "its attestation expired" if until else "it has not presented valid attestation evidence"
        return (f"coordinator_not_attested: this site verifies the coordinator before releasing updates and {why}; "
                "enable federation.attestation on the coordinator")
    bundle = env.bundle
    if bundle is not None and state.get("trusted_key") != base64.b64encode(
            raw_public(bundle.coordinator_seal_public)).decode():
        return "coordinator_not_attested: the attested key is not the coordinator's sealing key in our bundle"
    return None
