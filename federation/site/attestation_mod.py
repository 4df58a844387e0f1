"""The site's half of attested rounds, as a mod (torch-free, one ClientApp process per message).

Attestation rides on the messages a round sends anyway: any message may carry an ATTEST record,
and its answer rides back in the reply under the same key. The record may hold

- ``nonce``: a nonce the coordinator made. The site answers with evidence from its attester, bound
  to that nonce and to its Ed25519 update key, and, when it verifies the coordinator, a nonce of its
  own (``challenge``, kept in Flower's per-run `context.state` until the coordinator answers it);
- ``evidence``: the coordinator's answer to that challenge, evidence bound to its X25519 sealing
  key. The site appraises it with its own verifiers and policy and records until when the
  coordinator is trusted (``trusted_until`` in the answer).

The coordinator's evidence is appraised first, so a train message that carries it is judged on it.
Before any update leaves (a train message), `refusal` says whether the coordinator is currently
trusted; if not, the reply is a failure that says why, and the trainer is never called. Even a
refusal carries the site's own answer (its evidence and a fresh challenge), so the next message can
try again without an extra exchange. The site's settings come from its own file (node config
``attestation-config``), never from the coordinator.
"""

from __future__ import annotations

import base64
import hmac
import os
import time

from flwr.app import ConfigRecord, Context, Message, MessageType

from crypto.pki.keys import raw_public
from federation.config import SiteAttestation
from federation.protocol import message_keys as keys
from federation.site.replies import fail
from federation.site.site_env import SiteAttestationError, SiteEnv, site_env

STATE_KEY = "sovfl.attestation"  # this mod's record in context.state
NONCE_TTL_S = 300.0  # at least this long for the coordinator to answer our nonce
MAX_NONCE_TTL_S = 86_400.0  # and never longer, whatever the coordinator says it needs


def _state(context: Context) -> dict:
    rec = context.state.config_records.get(STATE_KEY)
    return dict(rec) if rec is not None else {}


def _save(context: Context, state: dict) -> None:
    context.state[STATE_KEY] = ConfigRecord(state)


def attestation_mod(msg: Message, context: Context, call_next) -> Message:
    """Answer the ATTEST record of any message; refuse a train message while the coordinator is not
    trusted."""
    request = msg.content.config_records.get(keys.ATTEST)
    is_train = msg.metadata.message_type == MessageType.TRAIN
    if request is None and not is_train:
        return call_next(msg, context)
    env = site_env(context)
    answer = respond(request, context, env) if request is not None else None
    if is_train:
        try:
            why = refusal(context, env)
        except SiteAttestationError as err:
            why = str(err)
        if why:
            refused = fail(msg, env.site, why)
            if answer is not None:
                refused.content[keys.ATTEST] = answer
            return refused
    reply = call_next(msg, context)
    if answer is not None and reply.has_content():
        reply.content[keys.ATTEST] = answer
    return reply


def respond(req: ConfigRecord, context: Context, env: SiteEnv) -> ConfigRecord:
    """The site's answer to an ATTEST record: the coordinator's evidence appraised, our evidence for
    its nonce. A failure is named in `error` (and `appraisal_error`), never raised."""
    # crypto.attestation (JOSE, X.509) loads only for a message that carries ATTEST: every other
    # message's fresh ClientApp process is spared its imports (protocol/message_cost.py)
    from crypto.attestation import AttestationError
    from crypto.attestation.models import unb64url

    out: dict = {}
    try:
        settings = env.attestation
        if settings is None:
            raise SiteAttestationError("the coordinator asks for attestation but this site has none configured; "
                                       "start its SuperNode with node config attestation-config=FILE")
        if env.bundle is None:
            raise SiteAttestationError("attestation binds the site's signing key: start the SuperNode with bundle-dir")
        if req.get("evidence"):
            try:
                out["trusted_until"] = _appraise_coordinator(context, env, settings, str(req["evidence"]))
            except (SiteAttestationError, AttestationError, KeyError, ValueError) as err:
                out["appraisal_error"] = f"attestation: {err}"
                state = _state(context)  # evidence that fails closes the door, whatever held before
                state.pop("trusted_until", None)
                state["refused"] = str(err)
                _save(context, state)
        if req.get("nonce"):
            ttl = min(MAX_NONCE_TTL_S, max(NONCE_TTL_S, float(req.get("answer_within_s", 0.0))))
            out.update(_evidence(context, env, settings, unb64url(str(req["nonce"])), ttl))
    except (SiteAttestationError, AttestationError, KeyError, ValueError) as err:
        out["error"] = f"attestation: {err}"
    return ConfigRecord(out)


def _evidence(context: Context, env: SiteEnv, settings: SiteAttestation, nonce: bytes, ttl_s: float) -> dict:
    from crypto.attestation import create_attester
    from crypto.attestation.models import b64url

    assert settings.attester is not None  # SiteAttestation validates it
    attester = create_attester(settings.attester.kind, env.site, settings.attester.config)
    evidence = attester.attest(nonce, raw_public(env.bundle.sign_key.public_key()))
    extra = {"evidence": evidence.model_dump_json()}
    if settings.verify_coordinator:
        ours = os.urandom(32)
        state = _state(context)
        state.update(nonce=b64url(ours), nonce_expires=time.time() + ttl_s)
        _save(context, state)
        extra["challenge"] = b64url(ours)
    return extra


def _appraise_coordinator(context: Context, env: SiteEnv, settings: SiteAttestation, evidence_json: str) -> float:
    """Appraise the coordinator's evidence for our outstanding nonce; until when it is trusted."""
    from crypto.attestation import Evidence, appraise, create_verifier
    from crypto.attestation.models import unb64url

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
    state = _state(context)
    state.update(trusted_until=until, trusted_key=base64.b64encode(seal_key).decode())
    state.pop("refused", None)
    _save(context, state)
    return until


def refusal(context: Context, env: SiteEnv) -> str | None:
    """Why this site must not release an update now, or None. Only sites that verify the
    coordinator refuse; the check is against the site's own record of its appraisal."""
    settings = env.attestation
    if settings is None or not settings.verify_coordinator:
        return None
    state = _state(context)
    until = float(state.get("trusted_until", 0.0))
    if until <= time.time():
        if state.get("refused"):
            return (f"coordinator_not_attested: this site verifies the coordinator before releasing updates and its "
                    f"evidence failed this site's appraisal ({state['refused']})")
        why = "its attestation expired" if until else "it has not presented valid attestation evidence"
        return (f"coordinator_not_attested: this site verifies the coordinator before releasing updates and {why}; "
                "enable federation.attestation on the coordinator")
    bundle = env.bundle
    if bundle is not None and state.get("trusted_key") != base64.b64encode(
            raw_public(bundle.coordinator_seal_public)).decode():
        return "coordinator_not_attested: the attested key is not the coordinator's sealing key in our bundle"
    return None


def coordinator_trusted(context: Context, env: SiteEnv) -> bool:
    """Whether this site holds a current appraisal of the coordinator, bound to the sealing key of
    its bundle (what a policy's `require_attestation` asks)."""
    state = _state(context)
    if float(state.get("trusted_until", 0.0)) <= time.time() or env.bundle is None:
        return False
    return state.get("trusted_key") == base64.b64encode(raw_public(env.bundle.coordinator_seal_public)).decode()
