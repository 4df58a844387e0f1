"""Write the seed corpus: tests/fuzz_corpus/<decoder>/seed-<n>.bin, made by the real encoders.

    .venv/bin/python tests/fuzzing/make_corpus.py            # decoders that have no seeds yet
    .venv/bin/python tests/fuzzing/make_corpus.py --force    # rewrite every decoder's seeds
    .venv/bin/python tests/fuzzing/make_corpus.py --pki      # also re-provision the PKI fixture

Seeds are written under the fuzz fixtures' fixed keys and frozen SecAgg round, with randomness and
the clock pinned, so they stay valid in later runs. Regression inputs (regress-*.bin, one per bug
found, listed in REGRESSIONS with the symptom they had) sit next to them; --regressions rewrites
them.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuzzing import fixtures  # noqa: E402
from fuzzing.harness import CORPUS_DIR, REGISTRY  # noqa: E402


def write_pki_fixture() -> None:
    """Public files of a freshly provisioned federation: what a coordinator and a site bundle hold."""
    from crypto.pki import provision

    with tempfile.TemporaryDirectory() as tmp:
        provision(tmp, ["site-a", "site-b"], federation_id="fuzz-fed")
        for bundle, src in (("coordinator", Path(tmp) / "coordinator"), ("site-a", Path(tmp) / "sites" / "site-a")):
            dst = fixtures.PKI_DIR / bundle
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir(parents=True)
            for name in fixtures.PKI_FILES:
                shutil.copyfile(src / name, dst / name)
    print(f"wrote the PKI fixture under {fixtures.PKI_DIR}")


def _claims(**changes: object) -> bytes:
    header = b'{"alg":"ES256","typ":"JWT","kid":"fuzz-es256"}'
    return header + b"\n" + json.dumps(fixtures.claims(**changes), separators=(",", ":")).encode()


def _roster(n: int) -> bytes:
    """A plan of n members, ME among them with its own channel key: the old share-keys request's
    roster bug (the plan took the roster's place when setup moved one round ahead)."""
    from crypto.secagg import wire
    from crypto.secagg.keys import public_from_private

    ids = sorted({*range(n), fixtures.ME})
    own = public_from_private(fixtures.secagg_round().channel_private)
    members = [wire.PlanMember(i, fixtures.site_of(i), own if i == fixtures.ME else (i + 1).to_bytes(32, "big"))
               for i in ids]
    return wire.encode_plan(fixtures.SECAGG_CTX, members)


def _jws_with(payload_suffix: str = "", header: bytes | None = None) -> bytes:
    from fuzzing.crypto_targets import jws_seeds

    h, p, s = jws_seeds()[0].decode().split(".")
    if header is not None:
        h = base64.urlsafe_b64encode(header).rstrip(b"=").decode()
    return f"{h}.{p}{payload_suffix}.{s}".encode()


def _site_manifest_without_coordinator() -> bytes:
    doc = json.loads(fixtures.pki_files()["site-a"]["manifest.json"])
    doc.pop("coordinator")
    return bytes([(0 << 1) | 1]) + json.dumps(doc).encode()  # selector: site-a bundle, manifest.json


def _version_edit(bundle: str, name: str, version_tlv: bytes, new: int) -> bytes:
    """A PEM file of the PKI fixture with its X.509 version number replaced (ASN.1 kept valid)."""
    pem = fixtures.pki_files()[bundle][name]
    lines = pem.strip().splitlines()
    der = bytearray(base64.b64decode(b"".join(lines[1:-1])))
    i = der.index(version_tlv)
    der[i + len(version_tlv) - 1] = new
    return lines[0] + b"\n" + base64.encodebytes(bytes(der)) + lines[-1] + b"\n"


# decoder -> regression name -> (input maker, the bug it pins: symptom before the fix)
REGRESSIONS = {
    "secagg-plan": {
        "roster-1100": (lambda: _roster(1100), "OverflowError in graph.binomial_tail (choose_degree scanned every k < n "
                        "with exact binomials; 1.6 s already at n = 1000)"),
        "roster-3000": (lambda: _roster(3000), "the client built the whole n x n complete graph to read its own row: "
                        "+344 MiB peak for a 24 KB message (and OverflowError first under this config)"),
    },
    "attestation-jws": {
        "non-ascii-payload": (lambda: _jws_with("\u00e9"), "UnicodeEncodeError from the signed input's ASCII encode"),
        "deep-header": (lambda: _jws_with(header=b"[" * 5000), "RecursionError from json.loads"),
    },
    "attestation-jwks": {
        "key-not-object": (lambda: b'{"keys":[true]}', "AttributeError: 'bool' object has no attribute 'get'"),
        "doc-not-object": (lambda: b"[]", "AttributeError: 'list' object has no attribute 'get'"),
        "deep": (lambda: b"[" * 5000, "RecursionError (and JSONDecodeError escaped Jwks.from_file as ValueError)"),
    },
    "attestation-eat-claims": {
        "exp-1e300": (lambda: _claims(exp=1e300), "OverflowError: timestamp out of range for platform time_t"),
        "exp-year-9999": (lambda: _claims(exp=253402300799), "OverflowError: date value out of range"),
        "iat-negative": (lambda: _claims(iat=-(10**18)), "OSError: [Errno 75] Value too large"),
        "nbf-nan": (lambda: _claims(nbf=float("nan")), "ValueError: Invalid value NaN"),
        "nonce-non-ascii": (lambda: _claims(eat_nonce="\u00e9"), "TypeError from hmac.compare_digest on non-ASCII str"),
        "key-hash-non-ascii": (lambda: _claims(sovfl_key_hash="\u00e9"), "TypeError from hmac.compare_digest"),
        "deep-claims": (lambda: b'{"alg":"ES256","kid":"fuzz-es256"}\n' + b"[" * 5000, "RecursionError"),
    },
    "attestation-insecure-dev": {
        "exp-1e300": (lambda: json.dumps({"exp": 1e300, "iat": 0, "measurements": {}}).encode(), "OverflowError"),
        "deep": (lambda: b"[" * 5000, "RecursionError from json.loads"),
    },
    "pki-trust-store": {
        "site-manifest-without-coordinator": (_site_manifest_without_coordinator, "AssertionError (an assert, gone "
                                              "under python -O: then AttributeError)"),
        "ca-version-7": (lambda: bytes([3 << 1]) + _version_edit("coordinator", "ca.crt", b"\xa0\x03\x02\x01\x02", 7),
                         "cryptography.x509.InvalidVersion (not a ValueError) escaped TrustStore.load"),
    },
    "pki-crl": {
        "version-0": (lambda: _version_edit("coordinator", "crl.pem", b"\x02\x01\x01", 0),
                      "cryptography.x509.InvalidVersion (not a ValueError) escaped load_verified_crl"),
    },
    "bulk-ref": {
        "deep-nesting": (lambda: b"[" * 4000 + b"]" * 4000, "RecursionError from json.loads in Ref.decode"),
        "offset-infinity": (lambda: b'{"root":"' + b"7" * 64 + b'","size":9,"chunk":65536,"offset":Infinity,'
                            b'"length":1,"stype":"x"}', "OverflowError from int(inf) in Ref.decode"),
    },
    "bulk-begin": {
        "deep-nesting": (lambda: b"[" * 100000 + b"]" * 100000, "RecursionError from json.loads in bulk_rpc.decode"),
    },
    "config-yaml": {
        "not-utf8": (lambda: b"sites: [\xff]\n", "known: config-not-utf8 (federation/config.py, not fixed here)"),
        "deep-nesting": (lambda: b"sites: " + b"[" * 5000 + b"]" * 5000 + b"\n", "known: config-deep-nesting"),
        "int-digits": (lambda: b"federation: {seed: " + b"9" * 5000 + b"}\nsites: [{id: a, partition: 0}]\n",
                       "known: config-int-digits"),
    },
}


def write_regressions() -> None:
    for name, cases in REGRESSIONS.items():
        d = CORPUS_DIR / name
        d.mkdir(parents=True, exist_ok=True)
        for case, (make, why) in cases.items():
            prefix = "known" if why.startswith("known:") else "regress"
            (d / f"{prefix}-{case}.bin").write_bytes(make())
    print(f"wrote {sum(map(len, REGRESSIONS.values()))} regression inputs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rewrite seeds of decoders that already have some")
    ap.add_argument("--pki", action="store_true", help="re-provision the PKI fixture (changes its CA)")
    ap.add_argument("--regressions", action="store_true", help="rewrite the regress-*.bin inputs of REGRESSIONS")
    ap.add_argument("targets", nargs="*", help="only these decoders")
    args = ap.parse_args()
    if args.pki or not (fixtures.PKI_DIR / "coordinator").is_dir():
        write_pki_fixture()
    from fuzzing import registry  # noqa: F401  (registers every decoder)

    if args.regressions:
        write_regressions()

    for name, target in sorted(REGISTRY.items()):
        if args.targets and name not in args.targets:
            continue
        d = CORPUS_DIR / name
        old = sorted(d.glob("seed-*.bin"))
        if old and not args.force:
            continue
        with fixtures.deterministic(f"corpus/{name}"), mock.patch("time.time", lambda: fixtures.NOW.timestamp()):
            seeds = [target.dump_seed(s) for s in target.seeds()]
        for p in old:
            p.unlink()
        d.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(seeds):
            (d / f"seed-{i}.bin").write_bytes(data)
        print(f"{name}: {len(seeds)} seeds, {sum(map(len, seeds))} bytes")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - started:.1f} s")
