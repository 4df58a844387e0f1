"""Checking audit logs: one log's chain and signatures (`verify`), and two parties' logs against
each other (`compare`): what one says it sent, the other says it received; every head one party
witnessed is an entry of the other's log.

A log alone proves its own consistency, not its completeness: cutting whole entries off its end
leaves a valid chain. That is what witnessing is for: the other party holds heads of this log
(index and hash), and `compare` finds each one in it, or says which is missing or differs.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from crypto.audit.log import GENESIS, OPENED, Head, entry_hash, key_of, log_path, signed_bytes, split_tail
from crypto.pki.keys import public_key_fingerprint, raw_public


@dataclass
class Verdict:
    """What `verify` found: the entries that verify (all of them when `ok`), the head they end in,
    and the first problem (`bad`: the entry it concerns)."""

    path: Path
    entries: list[dict] = field(default_factory=list)
    head: Head = Head(-1, GENESIS)
    problem: str | None = None
    bad: int | None = None

    @property
    def ok(self) -> bool:
        """Whether every line of the log verified."""
        return self.problem is None

    @property
    def opening(self) -> dict:
        """The opening entry's fields ({} without one)."""
        return self.entries[0]["fields"] if self.entries else {}

    def fail(self, index: int, why: str) -> "Verdict":
        """Stop at entry `index` for `why`."""
        self.problem, self.bad = f"entry {index}: {why}", index
        return self


def verify(where: str | Path, expected_key: ed25519.Ed25519PublicKey | None = None) -> Verdict:
    """Check the log of `where` (a workdir or the file): every line parses, counts on from the one
    before, chains to its hash and is signed by the key of entry 0 (which must be `expected_key`,
    when given). Stops at the first bad entry."""
    path = log_path(where)
    out = Verdict(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        out.problem = f"cannot read {path}: {err}"
        return out
    whole, torn = split_tail(data)
    key: ed25519.Ed25519PublicKey | None = None
    for n, line in enumerate(whole.splitlines()):
        try:
            entry = json.loads(line)
            index, prev, sig = entry["i"], entry["prev"], base64.b64decode(entry["sig"], validate=True)
            if not isinstance(entry["kind"], str) or not isinstance(entry["fields"], dict):
                raise TypeError("kind must be text and fields an object")
        except (ValueError, KeyError, TypeError) as err:
            return out.fail(n, f"line {n + 1} is not an audit entry ({err})")
        if index != n:
            return out.fail(n, f"line {n + 1} holds entry {index}: an entry was deleted, inserted or moved here")
        if prev != out.head.hash:
            return out.fail(n, "does not chain to the entry before it (that entry was edited, or entries were "
                               "deleted or reordered)")
        if n == 0:
            if entry["kind"] != OPENED:
                return out.fail(0, f"the first entry is {entry['kind']!r}, not {OPENED!r}")
            try:
                key = key_of(entry)
            except (ValueError, KeyError, TypeError) as err:
                return out.fail(0, f"the opening entry names no usable key ({err})")
            if expected_key is not None and raw_public(key) != raw_public(expected_key):
                return out.fail(0, f"the log is signed by key {public_key_fingerprint(key)}, not the party's "
                                   f"provisioned key {public_key_fingerprint(expected_key)} (a log re-signed by "
                                   "another key)")
        try:
            assert key is not None
            key.verify(sig, signed_bytes(entry))
        except InvalidSignature:
            return out.fail(n, f"{entry['kind']}: the signature does not verify (its content was edited, or "
                               "another key signed it)")
        out.entries.append(entry)
        out.head = Head(n, entry_hash(entry))
    if torn:
        out.problem = (f"torn last line after entry {out.head.index} ({len(torn)} bytes): a writer was stopped "
                       "mid-write; the party's next write records and removes it")
        out.bad = out.head.index + 1
    elif not out.entries:
        out.problem = f"{path} holds no entries"
    return out


def _entries(v: Verdict, kind: str) -> list[dict]:
    return [e for e in v.entries if e["kind"] == kind]


def witnessed(v: Verdict, other: Verdict, party: str) -> list[str]:
    """Problems with the heads of `other`'s log that `v`'s party witnessed (`witness` entries
    naming `party`): each must be an entry of `other`'s log with that very hash."""
    problems = []
    for e in _entries(v, "witness"):
        f = e["fields"]
        if f.get("party") != party:
            continue
        idx = int(f.get("index", -1))
        who = f"{v.opening.get('party')} entry {e['i']}"
        if idx >= len(other.entries):
            problems.append(f"{who} witnessed {party}'s head {idx}, but {party}'s log ends at entry "
                            f"{len(other.entries) - 1} (entries were cut off its end)")
        elif entry_hash(other.entries[idx]) != f.get("hash"):
            problems.append(f"{who} witnessed {party}'s entry {idx} with another hash: {party}'s log was "
                            "rewritten after the head was witnessed")
    return problems


def compare(coordinator: Verdict, site: Verdict) -> list[str]:
    """Problems between the coordinator's log and one site's (both verified on their own first):
    each party's key is the one the other recorded; every update the site logged as sent for a
    (run, round) is the one the coordinator logged as received from it, by digest, and the
    reverse; every head either witnessed of the other is in the other's log."""
    problems = [f"{v.path}: {v.problem}" for v in (coordinator, site) if not v.ok]
    if not coordinator.entries or not site.entries:
        return problems
    name, coord = site.opening.get("party"), coordinator.opening.get("party")
    known = [e["fields"].get("site_keys", {}) for e in _entries(coordinator, "run_started")]
    for keys in known:
        if name in keys and keys[name] != site.opening.get("key_fingerprint"):
            problems.append(f"site {name}'s log is signed by {site.opening.get('key_fingerprint')}, but the "
                            f"coordinator's registry names {keys[name]} for it")
            break
    want = site.opening.get("coordinator_key")
    if want and want != coordinator.opening.get("key_fingerprint"):
        problems.append(f"the coordinator's log is signed by {coordinator.opening.get('key_fingerprint')}, but "
                        f"site {name} holds {want} as its coordinator's key")
    sent = {(e["fields"].get("run"), e["fields"].get("round")): (e["i"], e["fields"].get("digest"))
            for e in _entries(site, "update_sent")}
    got = {(e["fields"].get("run"), e["fields"].get("round")): (e["i"], e["fields"].get("digest"))
           for e in _entries(coordinator, "update_received") if e["fields"].get("site") == name}
    for (run, rnd), (i, digest) in sorted(sent.items(), key=str):
        if (run, rnd) not in got:
            problems.append(f"site {name} entry {i}: update of run {run} round {rnd} ({digest}) sent, none "
                            "received by the coordinator")
        elif got[(run, rnd)][1] != digest:
            problems.append(f"site {name} entry {i}: update of run {run} round {rnd} sent as {digest}, the "
                            f"coordinator's entry {got[(run, rnd)][0]} received {got[(run, rnd)][1]}")
    for (run, rnd), (i, digest) in sorted(got.items(), key=str):
        if (run, rnd) not in sent:
            problems.append(f"coordinator entry {i}: received an update of run {run} round {rnd} from {name} "
                            f"({digest}) that the site's log does not say it sent")
    return problems + witnessed(coordinator, site, name) + witnessed(site, coordinator, coord)


def expected_key(bundle_dir: str | Path, party: str) -> ed25519.Ed25519PublicKey:
    """The provisioned signing key of `party` as a bundle knows it: from its CA-signed registry (a
    coordinator's bundle knows every site, a site's its coordinator), or the bundle's own key."""
    from crypto.pki import TrustStore
    from crypto.pki.keys import load_private
    from crypto.pki.manifest import MANIFEST, BundleManifest

    d = Path(bundle_dir)
    rec = TrustStore.load(d).lookup(party)
    if rec is not None:
        return rec.sign_public
    m = BundleManifest.model_validate_json((d / MANIFEST).read_text())
    if m.party != party:
        raise LookupError(f"the bundle {d} knows no party {party!r}")
    key = load_private(d / m.files["sign_key"])
    assert isinstance(key, ed25519.Ed25519PrivateKey)
    return key.public_key()
