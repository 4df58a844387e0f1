"""The coordinator's audit log (crypto/audit), as a round hook: signed with its provisioned key, in
its workdir (audit.jsonl), continued by a resumed run.

It records the run's start (config digest, code version, CA and key fingerprints, each site's
registered key), each site that enrolled, each round's group, settings and the digest of the
global model it starts from (the previous round's aggregate applied), the digest of every update
received (what the site signed: protocol/site_terms.update_digest), the sites left out and
why (policy refusals and other rejections), the mean update's digest when it is in memory, and
each checkpoint once written (`checkpointed`). Cross-witnessing: every
reply carries the site's log head, recorded here (`witness`); every message of a round carries
this log's head (AUDIT) and the round's terms (TERMS), which the sites' policies judge.
Policy refusals are counted as `rejections.policy:<code>` and named in the line's `policy_refused`.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from flwr.app import ConfigRecord, Message, MessageType

from crypto.audit import LOG_NAME, AuditLog, AuditLogError, Head, digest_of
from crypto.pki import CoordinatorBundle
from crypto.pki.keys import cert_fingerprint, load_cert, public_key_fingerprint
from federation.config.schema import ExperimentConfig
from federation.coordinator.round_hooks import RoundHook
from federation.coordinator.roster import Roster
from federation.coordinator.strategy import Rider, RoundOutcome
from federation.protocol import message_keys as keys
from federation.protocol.codecs import Arrays
from federation.protocol.site_terms import RoundTerms, head_of, update_digest

log = logging.getLogger("sovfl.coordinator")
POLICY_CODE = re.compile(r"\b(policy_[a-z_]+):")


def code_version() -> str:
    """The installed sovereign-fl version."""
    try:
        return version("sovereign-fl")
    except PackageNotFoundError:
        return "unknown"


def arrays_digest(arrays: Arrays | object | None) -> str | None:
    """``sha256:<hex>`` over the arrays' names, dtypes, shapes and bytes in name order (None: no
    arrays in memory, e.g. a mean still spilled to disk)."""
    if not isinstance(arrays, dict):
        return None
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype.str}|{tuple(a.shape)}|".encode())
        h.update(memoryview(a).cast("B") if a.flags.c_contiguous else a.tobytes())
    return "sha256:" + h.hexdigest()


class AuditHook(RoundHook):
    """Writes the coordinator's log; rides the round's terms and its head on the round's messages."""

    def __init__(self, log: AuditLog, cfg: ExperimentConfig, bundle: CoordinatorBundle, roster: Roster, run_id: int,
                 model: Callable[[], Arrays]):
        self.log, self.cfg, self.fed, self.roster, self.run_id = log, cfg, cfg.federation, roster, run_id
        self.model = model
        self.lock = threading.Lock()
        trust = bundle.trust()
        self.head = log.append(
            "run_started", run=run_id, config_digest=digest_of(cfg.model_dump(mode="json")),
            code_version=code_version(), federation=self.fed.name, ca_fingerprint=cert_fingerprint(
                load_cert(bundle.ca_cert)), key_fingerprint=public_key_fingerprint(bundle.sign_key.public_key()),
            site_keys={n: public_key_fingerprint(r.sign_public) for n, r in trust.parties.items() if r.role == "site"},
            rounds=self.fed.rounds, strategy=self.fed.strategy, update_kind=self.fed.update_kind,
            codec=self.fed.codec, seal=self.fed.seal, secagg=self.fed.secagg.enabled,
            attestation=self.fed.attestation.enabled)
        self.error = ""

    def write(self, entries: list[tuple[str, dict]]) -> Head:
        """Append `entries`; the new head. A write that fails (a full disk) never fails the round:
        the error is logged and named in the next metrics line (`audit_error`)."""
        with self.lock:
            if entries:
                try:
                    self.head = self.log.extend(entries)
                except (AuditLogError, OSError, TypeError, ValueError) as err:
                    self.error = f"audit log {self.log.path}: {err}"
                    log.warning("%s", self.error)
            return self.head

    def witness(self, site: str, status) -> list[tuple[str, dict]]:
        """The site's head a reply's STATUS carries, as an entry."""
        head = head_of(status)
        return [("witness", {"party": site, "index": head[0], "hash": head[1]})] if head else []

    def enrolled(self, node: int, site: str, status: ConfigRecord) -> None:
        """A site enrolled at discovery, and its head."""
        self.write([("site_enrolled", {"run": self.run_id, "site": site, "node": node,
                                       "num_examples": int(status.get("num_examples", 0) or 0)}),
                    *self.witness(site, status)])

    def riders(self, rnd: int, nodes: list[int], upcoming: set[str], t0: float) -> list[Rider]:
        """The round's terms and this log's head, on every message of the round."""
        group = sorted(self.roster.site_name(n) for n in nodes)
        terms = RoundTerms(self.run_id, rnd, self.fed.rounds, self.fed.strategy, self.fed.secagg.enabled, group)
        self.write([("round_started", {"run": self.run_id, "round": rnd, "group": group,
                                       "model_digest": arrays_digest(self.model()), "strategy": self.fed.strategy,
                                       "update_kind": self.fed.update_kind, "seal": self.fed.seal,
                                       "secagg": self.fed.secagg.enabled, "codec": self.fed.codec})])
        return [_AuditRider(self, rnd, terms.to_record())]

    def after_round(self, rnd: int, out: RoundOutcome, timing: dict, rejections: Counter[str]) -> None:
        """Policy refusals counted by code; the round's outcome and aggregate digest recorded."""
        refused = {}
        for site, reason in out.failed.items():
            m = POLICY_CODE.search(reason)
            if m:
                refused[site] = m.group(1)
                rejections["policy:" + m.group(1)] += 1
        if refused:
            out.extra["policy_refused"] = refused
        self.write([("round_closed", {"run": self.run_id, "round": rnd, "aggregated": sorted(out.per_site),
                                      "count": out.count, "failed": dict(out.failed), "policy_refused": refused,
                                      "aggregate_digest": arrays_digest(out.mean)})])

    def checkpointed(self, line: dict) -> None:
        """Round `line["round"]`'s checkpoint and metrics line are on disk (run_log.RunLog.listeners;
        on the writer's thread when it writes in the background)."""
        self.write([("checkpoint_written", {"run": self.run_id, "round": line.get("round"),
                                            "status": line.get("status")})])

    def metrics(self, rnd: int, line: dict) -> None:
        """This log's head after the round, and the last write that failed, if any."""
        line["audit_head"] = self.head.as_dict()
        if self.error:
            line["audit_error"], self.error = self.error, ""


class _AuditRider:
    """TERMS and AUDIT on the round's messages; the sites' heads and updates from their replies."""

    def __init__(self, hook: AuditHook, rnd: int, terms: ConfigRecord):
        self.hook, self.rnd, self.terms = hook, rnd, terms

    def records(self, node: int) -> dict:
        """The round's terms and the log's current head."""
        return {keys.TERMS: self.terms, keys.AUDIT: ConfigRecord(self.hook.head.as_dict())}

    def wanted(self) -> list[int]:
        """Nothing of its own to send."""
        return []

    def take(self, node: int, reply: Message | None) -> None:
        """Record the site's head and, for a train reply, the digest of its update."""
        if reply is None or not reply.has_content():
            return
        site = self.hook.roster.site_name(node)
        status = reply.content.config_records.get(keys.STATUS)
        entries = []
        if reply.metadata.message_type == MessageType.TRAIN and status is not None and status.get("ok"):
            entries.append(("update_received", {"site": site, "run": self.hook.run_id, "round": self.rnd,
                                                "digest": update_digest(reply.content)}))
        self.hook.write(entries + self.hook.witness(site, status))


def audit_hook(workdir: Path, cfg: ExperimentConfig, bundle: CoordinatorBundle, roster: Roster,
               run_id: int, model: Callable[[], Arrays]) -> AuditHook:
    """The hook over the coordinator's log in `workdir` (opened, or continued by a resumed run)."""
    log = AuditLog(workdir / LOG_NAME, bundle.sign_key, bundle.name, "coordinator", {
        "federation": bundle.federation_id, "ca_fingerprint": cert_fingerprint(load_cert(bundle.ca_cert))})
    return AuditHook(log, cfg, bundle, roster, run_id, model)
