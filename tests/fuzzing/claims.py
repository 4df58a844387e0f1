"""Inputs whose headers claim a huge size (2**40 elements or bytes, or the largest a field holds):
each must be refused before anything of that size is allocated.

tests/test_fuzz_decoders.py feeds them to their decoders twice: in-process under tracemalloc (the
peak must stay small), and in a child process whose address space is limited (RLIMIT_AS), where an
attempt to allocate the claimed size would fail loudly instead of being lazily overcommitted.

    python tests/fuzzing/claims.py HEADROOM_BYTES   # the child: exit 0 iff every claim is cleanly rejected
"""

from __future__ import annotations

import base64
import json
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HUGE = 2**40


def _envelope_header(**changes: Any) -> bytes:
    from crypto.envelope import MAGIC, EnvelopeHeader

    from .crypto_targets import envelope_seeds

    h = EnvelopeHeader.decode(envelope_seeds()[1].header)  # a sealed one
    fields = {name: getattr(h, name) for name in EnvelopeHeader._FIELDS}
    fields.update(changes)
    parts = [MAGIC]
    for name in EnvelopeHeader._FIELDS:
        v = fields[name]
        raw = (v.encode() if isinstance(v, str) else bytes([v]) if isinstance(v, bool)
               else struct.pack(">Q", v) if isinstance(v, int) else bytes(v))
        parts += [struct.pack(">I", len(raw)), raw]
    return b"".join(parts)


def _framed(header: bytes, body: bytes = b"\0" * 64) -> bytes:
    return struct.pack(">I", len(header)) + header + body


def _secagg(kind: str, body: bytes, addressed: bool = True) -> bytes:
    """A SecAgg+ message header of this round (addressed to or from ME unless `addressed` is
    False: the plan goes to every member alike), then ``body``."""
    from crypto.secagg.wire import MAGIC, MsgType

    from .fixtures import ME, SECAGG_CTX

    rid = SECAGG_CTX.run_id.encode()
    return (MAGIC + bytes([MsgType[kind]]) + bytes([len(rid)]) + rid + struct.pack(">Q", SECAGG_CTX.round)
            + (struct.pack(">Q", ME) if addressed else b"") + body)


def _big_plan() -> bytes:
    from crypto.secagg import wire
    from crypto.secagg.keys import public_from_private

    from .fixtures import ME, SECAGG_CTX, secagg_round, site_of

    own = public_from_private(secagg_round().channel_private)
    return wire.encode_plan(SECAGG_CTX, [wire.PlanMember(i, site_of(i), own if i == ME else (i + 1).to_bytes(32, "big"))
                                         for i in sorted({*range(8192), ME})])


def _seed_fields() -> tuple[bytes, bytes, bytes]:
    from .crypto_targets import envelope_seeds

    e = envelope_seeds()[1]
    return e.header, e.signature, bytes(e.body)


def _eat_claims(**changes: Any) -> bytes:
    from .fixtures import claims as make_claims

    return b'{"alg":"ES256","typ":"JWT","kid":"fuzz-es256"}\n' + json.dumps(make_claims(**changes)).replace(
        " ", "").encode()


def _der_with_length(pem: bytes, length: int) -> bytes:
    """The PEM's DER with its outer SEQUENCE length rewritten (long form, 8 length bytes)."""
    lines = pem.strip().splitlines()
    der = base64.b64decode(b"".join(lines[1:-1]))
    hdr = 2 + (der[1] & 0x7F if der[1] & 0x80 else 0)
    der = b"\x30\x88" + length.to_bytes(8, "big") + der[hdr:]
    return lines[0] + b"\n" + base64.encodebytes(der) + lines[-1] + b"\n"


def claims() -> list[tuple[str, str, Callable[[], Any]]]:
    """(what, decoder name, input maker)."""
    from .fixtures import PKI_BUNDLES, pki_files
    from .protocol_targets import protocol_claims

    u32max = 2**32 - 1
    return [
        ("envelope payload_len 2**40 (sealed, signed by the site)", "envelope-signed",
         lambda: _framed(_envelope_header(payload_len=HUGE))),
        ("envelope payload_len 2**64-1 (sealed, signed by the site)", "envelope-signed",
         lambda: _framed(_envelope_header(payload_len=2**64 - 1))),
        ("envelope chunk size 2**40", "envelope-signed", lambda: _framed(_envelope_header(chunk_size=HUGE))),
        ("envelope header field length 2**32-1", "envelope-header",
         lambda: _envelope_header()[:20] + struct.pack(">I", u32max) + b"x" * 16),
        ("envelope blob header/signature lengths 2**32-1", "envelope-blob",
         lambda: struct.pack(">II", u32max, u32max) + b"\0" * 32),
        ("envelope header given as the int 2**40", "envelope-fields", lambda: (HUGE, b"\0" * 64, b"")),
        ("envelope signature given as the int 2**40", "envelope-fields", lambda: (_seed_fields()[0], HUGE, b"")),
        ("envelope body given as the int 2**40 (genuine header)", "envelope-fields",
         lambda: (*_seed_fields()[:2], HUGE)),
        ("plan member count 2**32-1", "secagg-plan",
         lambda: _secagg("PLAN", struct.pack(">I", u32max) + b"\0" * 64, addressed=False)),
        ("plan naming 8192 clients (420 KiB): one neighbour row, not the n x n graph", "secagg-plan", _big_plan),
        ("masked-input request relayed count 2**20 (at the cap)", "secagg-masked-input-request",
         lambda: _secagg("MASKED_INPUT_REQUEST", bytes([16]) + struct.pack(">II", 256, 10) + struct.pack(">I", 2**20))),
        ("setup envelope blob 2**32-1 bytes", "secagg-setup",
         lambda: _secagg("SETUP", b"\0" * 64 + struct.pack(">I", 1) + struct.pack(">Q", 2)
                         + struct.pack(">I", u32max) + b"\0" * 40)),
        ("packed masked words: 2**32-1 words claimed in 64 bytes", "secagg-packed-words",
         lambda: bytes([8]) + struct.pack(">I", u32max) + b"\0" * 64),
        ("unmask reply share count 2**32-1", "secagg-unmask-reply",
         lambda: _secagg("UNMASK_REPLY", struct.pack(">I", u32max))),
        ("unmask request survivor count 2**32-1", "secagg-unmask-request",
         lambda: _secagg("UNMASK_REQUEST", struct.pack(">I", u32max))),
        ("masked chunk at word offset 2**40", "secagg-masked-chunk",
         lambda: HUGE.to_bytes(8, "big") + b"\0" + b"\0" * 64),
        ("JWS header with a 5000-digit number", "attestation-jws",
         lambda: base64.urlsafe_b64encode(b'{"alg":"ES256","x":1' + b"0" * 5000 + b"}").rstrip(b"=") + b".e30.AAAA"),
        ("signed EAT claims with a 5000-digit number", "attestation-eat-claims",
         lambda: _eat_claims(exp=None).replace(b'"exp":null', b'"exp":1' + b"0" * 5000)),
        ("signed EAT claims: exp 2**40 days in seconds", "attestation-eat-claims",
         lambda: _eat_claims(exp=HUGE * 86400)),
        ("insecure-dev evidence exp 1e308", "attestation-insecure-dev",
         lambda: json.dumps({"exp": 1e308, "iat": 1e308, "measurements": {}}).encode()),
        ("CRL whose DER claims 2**40 bytes", "pki-crl", lambda: _der_with_length(pki_files()[PKI_BUNDLES[0]]["crl.pem"],
                                                                            HUGE)),
        ("CA certificate whose DER claims 2**40 bytes", "pki-trust-store",
         lambda: bytes([3 << 1]) + _der_with_length(pki_files()[PKI_BUNDLES[0]]["ca.crt"], HUGE)),
        *protocol_claims(),
    ]


def main() -> None:
    """Child side of the RLIMIT_AS test: every claim must end as a clean rejection."""
    import resource

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzzing import registry  # noqa: F401
    from fuzzing.harness import REGISTRY, run_one

    headroom = int(sys.argv[1])
    made = [(what, name, make()) for what, name, make in claims()]  # built before the limit
    for name in {n for _, n, _ in made}:  # fixtures too
        run_one(REGISTRY[name], made[[n for _, n, _ in made].index(name)][2], check_alloc=False)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
    print(f"address space limited to {(vm + headroom) >> 20} MiB ({headroom >> 20} MiB above the setup)")
    bad = 0
    for what, name, data in made:
        outcome = run_one(REGISTRY[name], data, check_alloc=False)
        ok = outcome.kind == "rejected"
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {name}: {what}: {outcome.kind} {outcome.label}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzzing.claims import main as _main

    _main()
