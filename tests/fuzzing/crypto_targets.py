"""Decoders of crypto/ as fuzz targets: an adapter from wire input to the real call, the genuine
encodings that seed it, and (where random edits cannot get past a signature or a MAC) a
structure-aware strategy that re-signs or re-seals what it mutated, as a registered but hostile
party would.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import strategies as st

from crypto.attestation import jose as jws
from crypto.attestation.models import Evidence, b64url, parse_evidence
from crypto.envelope import Envelope, ReplayGuard, make_envelope, open_envelope
from crypto.pki import TrustStore
from crypto.pki.manifest import parse_manifest, parse_signed_registry
from crypto.pki.revocation import parse_verified_crl
from crypto.secagg import RoundPlan, SecAggClient, ring, signing, wire

from . import fixtures as fx
from .mutate import PROGRAM, apply_byte_program, as_text, mutated_bytes, mutated_json

# -- envelopes ----------------------------------------------------------------------------------


def _frame(header: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(header)) + header + body


def _unframe(data: bytes) -> tuple[bytes, bytes]:
    n = int.from_bytes(data[:4], "big") if len(data) >= 4 else 0
    return data[4:4 + n], data[4 + n:]


def envelope_seeds() -> list[Envelope]:
    seal = fx.coordinator_seal_key().public_key()
    key = fx.site_key()
    common = {"signing_key": key, "federation_id": fx.FEDERATION, "run_id": "run-1", "round": 4, "site": fx.SITE}
    payload = np.arange(2300, dtype=np.float32).tobytes()  # 9200 bytes: three 4 KiB chunks
    return [
        make_envelope(b"hello update", **common),
        make_envelope(b"sealed hello", seal_to=seal, **common),
        make_envelope(payload, seal_to=seal, chunk_size=4096, meta=b'{"layout":[["w",[2300],"float32"]]}', **common),
        make_envelope(payload, chunk_size=4096, digest_alg="blake2b", **common),
        make_envelope(b"", seal_to=seal, channel="downlink", **common),
    ]


def _open(env: Envelope) -> object:
    return open_envelope(env, trust=fx.trust_store(), federation_id=fx.FEDERATION, run_id="run-1", round=4,
                         replay=ReplayGuard(), recipient_key=fx.coordinator_seal_key())  # as the coordinator does


def decode_envelope_blob(data: bytes) -> object:
    return _open(Envelope.from_bytes(data))


def decode_envelope_signed(data: bytes) -> object:
    """Header and body as a registered site sent them: the site signs whatever header it made."""
    header, body = _unframe(data)
    return _open(Envelope(header, fx.site_key().sign(header), body))


def decode_envelope_fields(fields: tuple[Any, Any, Any]) -> object:
    """The three values a receiver takes out of a message record, of whatever type the peer chose."""
    return _open(Envelope(*fields))


_RECORD_VALUE = st.one_of(st.binary(max_size=64), st.integers(-(2**64), 2**64), st.sampled_from([2**40, 2**33, -1]),
                          st.floats(), st.text(max_size=16), st.booleans(), st.none(),
                          st.lists(st.integers(0, 255), max_size=8))


def envelope_fields_strategy(seeds: Sequence[Any]) -> st.SearchStrategy[tuple[Any, Any, Any]]:
    good = [s for s in seeds if isinstance(s, tuple)]
    swap = st.builds(lambda s, i, v: tuple(v if j == i else x for j, x in enumerate(s)),
                     st.sampled_from(good), st.integers(0, 2), _RECORD_VALUE)
    arrays = st.builds(lambda s, dtype: (s[0], s[1], np.frombuffer(bytes(s[2]), np.uint8).view(dtype)
                                         if len(s[2]) % np.dtype(dtype).itemsize == 0 else np.asarray(s[2])),
                       st.sampled_from(good), st.sampled_from(["u1", "<u4", ">f8", "u8"]))
    strided = st.builds(lambda s: (s[0], s[1], np.frombuffer(bytes(s[2]) * 2, np.uint8)[::2]), st.sampled_from(good))
    return st.one_of(swap, arrays, strided, st.tuples(_RECORD_VALUE, _RECORD_VALUE, _RECORD_VALUE))


def envelope_fields_seed(blob: bytes) -> tuple[Any, Any, Any]:
    env = Envelope.from_bytes(blob)
    return env.header, env.signature, bytes(env.body)


# -- SecAgg+ ------------------------------------------------------------------------------------


def decode_advert(data: bytes) -> object:
    """ME's signed advert as the coordinator reads it next to ME's setup."""
    return wire.decode_advert(fx.SECAGG_CTX, data, fx.ME)


def decode_plan(data: bytes) -> object:
    """A round's plan as ME's site receives it, then ME's setup from it (a hostile coordinator's plan)."""
    r = fx.secagg_round()
    plan = RoundPlan.decode(fx.SECAGG_CONFIG, fx.SECAGG_CTX, data)
    return SecAggClient.setup(fx.SECAGG_CONFIG, plan, fx.ME, r.channel_private)


def decode_setup(data: bytes) -> object:
    return fx.secagg_round().server_at(2).receive_setup(fx.ME, data)


def _relayed_to_me() -> tuple[wire.RingSpec, list[wire.Relayed]]:
    return wire.decode_masked_input_request(fx.SECAGG_CTX, fx.secagg_round().requests["masked_input"], fx.ME)


def decode_advert_signatures(data: bytes) -> object:
    r = fx.secagg_round()
    return signing.check_relayed_adverts(_relayed_to_me()[1], data, trust=r.trust, federation_id=fx.FEDERATION,
                                         ctx=fx.SECAGG_CTX, me=fx.ME, names={c: fx.site_of(c) for c in fx.CLIENTS})


def decode_masked_input_request(data: bytes) -> object:
    return fx.secagg_round().client_at(3).receive_shares(data)


def decode_share_envelope(data: bytes) -> object:
    src = min(fx.secagg_round().channel_keys)
    return wire.open_envelope(fx.secagg_round().channel_keys[src], fx.SECAGG_CTX, src, fx.ME, data)


def decode_share_plaintext(data: bytes) -> object:
    """What a neighbour sealed to ME under their genuine channel key (a hostile neighbour's shares)."""
    r = fx.secagg_round()
    spec, relayed = _relayed_to_me()
    src = min(x.client for x in relayed)
    relayed = [wire.Relayed(x.client, x.s_pk, wire.seal_envelope(r.channel_keys[src], fx.SECAGG_CTX, src, fx.ME, data))
               if x.client == src else x for x in relayed]
    return r.client_at(3).receive_shares(wire.encode_masked_input_request(fx.SECAGG_CTX, fx.ME, spec, relayed))


def decode_packed_words(data: bytes) -> object:
    """A masked chunk's packed bytes as the coordinator unpacks them: width and word count from the
    chunk's name and the round (here from the input's first five bytes), then the site's bytes."""
    if len(data) < 5:
        data = data + bytes(5 - len(data))
    bits = ring.MIN_BITS + data[0] % (ring.MAX_BITS - ring.MIN_BITS + 1)
    return ring.unpack_words(np.frombuffer(data[5:], np.uint8), bits, int.from_bytes(data[1:5], "big"))


def packed_words_seeds() -> list[bytes]:
    out = []
    for bits in (8, 12, 16, 20, 32):
        words = (np.arange(37, dtype=np.uint64) * 2654435761) % (1 << bits)
        out.append(bytes([bits - ring.MIN_BITS]) + len(words).to_bytes(4, "big")
                   + ring.pack_words(words.astype(np.uint32), bits).tobytes())
    return out


def decode_masked_chunk(data: bytes) -> object:
    """A masked chunk as the driver hands it over: a word offset and an array of the peer's dtype."""
    offset = int.from_bytes(data[:8], "big")
    dtype = ["<u4", ">u4", "<u8", "<i4", "<f4", "u1"][data[8] % 6] if len(data) > 8 else "<u4"
    raw = data[9:]
    raw = raw[: len(raw) - len(raw) % np.dtype(dtype).itemsize]
    return fx.secagg_round().server_at(3).add_masked_chunk(fx.ME, offset, np.frombuffer(raw, dtype))


def masked_chunk_seeds() -> list[bytes]:
    return [off.to_bytes(8, "big") + b"\x00" + words.astype("<u4").tobytes() for off, words in fx.secagg_round().chunks]


def decode_unmask_request(data: bytes) -> object:
    return fx.secagg_round().client_at(4).unmask(data)


def decode_unmask_reply(data: bytes) -> object:
    """ME's unmask reply is the last one; the server then rebuilds every secret from the shares."""
    server = fx.secagg_round().server_at(4)
    server.receive_unmask(fx.ME, data)
    return server.finish()


def decode_secagg_signature(data: bytes) -> object:
    r = fx.secagg_round()
    header, sig = _unframe(data)
    return signing.verify(signing.Signature(header, sig), r.sent["advert"], trust=r.trust,
                          federation_id=fx.FEDERATION, ctx=fx.SECAGG_CTX, stage=1, site=fx.site_of(fx.ME),
                          replay=ReplayGuard())


_ID = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from(fx.CLIENTS))
_IDS = st.one_of(st.lists(_ID, max_size=12), st.builds(lambda a, n, me: sorted({*range(a, a + n), me}),
                                                       st.integers(0, 2**20), st.integers(0, 6000),
                                                       st.sampled_from([fx.ME, 0])))
_KEY32 = st.one_of(st.binary(min_size=32, max_size=32), st.sampled_from([b"\x00" * 32, b"\x01" + b"\x00" * 31,
                                                                         b"\xff" * 32]))


def secagg_grammar(kind: str) -> st.SearchStrategy[bytes]:
    """Well-formed messages of one kind with hostile contents, from the real encoder."""
    ctx, me = fx.SECAGG_CTX, st.one_of(st.just(fx.ME), _ID)
    blobs = st.dictionaries(_ID, st.binary(max_size=120), max_size=8)
    if kind == "advert":
        return st.builds(lambda c, a: wire.encode_advert(ctx, wire.Advert(c, a)), me, _KEY32)
    if kind == "plan":
        names = st.one_of(st.sampled_from([fx.site_of(c) for c in fx.CLIENTS]), st.text(max_size=12))
        members = st.lists(st.builds(wire.PlanMember, _ID, names, _KEY32), max_size=10)
        own = wire.PlanMember(fx.ME, fx.site_of(fx.ME), _own_channel_pk())
        return st.builds(lambda ms, mine: wire.encode_plan(ctx, ms + [own] if mine else ms), members, st.booleans())
    if kind == "setup":
        return st.builds(lambda c, pk, com, envs: wire.encode_setup(ctx, wire.Setup(c, pk, com, envs)),
                         me, _KEY32, _KEY32, blobs)
    if kind == "masked_input_request":
        spec = st.builds(wire.RingSpec, st.integers(0, 255), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
        relayed = st.lists(st.builds(wire.Relayed, _ID, _KEY32, st.binary(max_size=120)), max_size=8)
        return st.builds(lambda c, r, x: wire.encode_masked_input_request(ctx, c, r, x), me, spec, relayed)
    if kind == "unmask_request":
        return st.builds(lambda c, s, d: wire.encode_unmask_request(ctx, c, s, d), me, _IDS, _IDS)
    if kind == "unmask_reply":
        shares = st.lists(st.tuples(_ID, st.sampled_from(list(wire.ShareKind)), st.binary(max_size=50)), max_size=8)
        return st.builds(lambda c, s: wire.encode_unmask_reply(ctx, c, s), me, shares)
    if kind == "advert_signatures":
        sigs = st.dictionaries(_ID, st.tuples(st.binary(max_size=300), st.binary(max_size=70)), max_size=6)
        return st.builds(lambda c, s: wire.encode_advert_signatures(ctx, c, s), me, sigs)
    raise KeyError(kind)


def _own_channel_pk() -> bytes:
    from crypto.secagg.keys import public_from_private

    return public_from_private(fx.secagg_round().channel_private)


def with_grammar(kind: str) -> Any:
    def strategy(seeds: Sequence[Any]) -> st.SearchStrategy[bytes]:
        return st.one_of(mutated_bytes(seeds), secagg_grammar(kind))

    return strategy


def share_plaintext_strategy(seeds: Sequence[Any]) -> st.SearchStrategy[bytes]:
    from crypto.secagg import shamir

    x = shamir.x_for(fx.ME).to_bytes(9, "big")
    share = st.builds(lambda y: x + y.to_bytes(33, "big"), st.sampled_from([0, 1, shamir.PRIME - 1, shamir.PRIME,
                                                                            2**264 - 1]))
    pairs = st.builds(lambda a, b: a + b, share, share)
    return st.one_of(mutated_bytes(seeds), pairs, st.binary(max_size=100))


def share_plaintext_seeds() -> list[bytes]:
    r = fx.secagg_round()
    src = min(x.client for x in _relayed_to_me()[1])
    envelope = next(x.envelope for x in _relayed_to_me()[1] if x.client == src)
    return [wire.open_envelope(r.channel_keys[src], fx.SECAGG_CTX, src, fx.ME, envelope)]


# -- attestation --------------------------------------------------------------------------------


def decode_jws(data: bytes) -> object:
    iss = fx.issuer()
    return jws.verify_jws(as_text(data), iss.jwks, jws.SUPPORTED_ALGS)


def jws_seeds() -> list[bytes]:
    iss = fx.issuer()
    return [jws.sign_jws(fx.claims(), key, alg, kid).encode() for kid, (key, alg) in iss.keys.items()]


def _jws_parts(token: bytes) -> tuple[bytes, bytes, bytes] | None:
    from crypto.attestation.models import unb64url

    try:
        h, p, s = token.decode().split(".")
        return unb64url(h), unb64url(p), unb64url(s)
    except ValueError:
        return None


def jws_strategy(seeds: Sequence[Any]) -> st.SearchStrategy[bytes]:
    """Tokens whose parts were edited one by one (header or claims as JSON, signature as bytes)."""
    parts = [p for p in (_jws_parts(s) for s in seeds) if p is not None]
    headers = [p[0] for p in parts]

    def join(h: bytes, p: bytes, s: bytes) -> bytes:
        return f"{b64url(h)}.{b64url(p)}.{b64url(s)}".encode()

    part_edit = st.builds(lambda parts_, h, p, s, which: join(*(h if which == 0 else parts_[0],
                                                                p if which == 1 else parts_[1],
                                                                s if which == 2 else parts_[2])),
                          st.sampled_from(parts), mutated_json(headers), mutated_json([q[1] for q in parts]),
                          mutated_bytes([q[2] for q in parts]), st.integers(0, 2))
    return st.one_of(part_edit, part_edit, mutated_bytes(seeds),
                     st.text(alphabet="AaZz09_-.=+/ \u00e9\ud800", max_size=80).map(lambda t: t.encode("utf-8",
                                                                                                     "surrogatepass")))


def decode_eat_token(data: bytes) -> object:
    """Header and claims of a token that the trusted attestation service really signed (ES256)."""
    header, _, claims_ = data.partition(b"\n")
    key, kid = fx.issuer().key("ES256")
    h64, p64 = b64url(header), b64url(claims_)
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    r, s = decode_dss_signature(key.sign(f"{h64}.{p64}".encode(), ec.ECDSA(hashes.SHA256())))
    token = f"{h64}.{p64}.{b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"
    ev = Evidence(format="eat-jwt", attester=fx.SITE, nonce=b64url(fx.NONCE), public_key=b64url(fx.ATTESTED_KEY),
                  payload=token)
    return fx.POLICY.evaluate(fx._verifiers()[0].verify(ev, nonce=fx.NONCE, now=fx.NOW), nonce=fx.NONCE,
                              public_key=fx.ATTESTED_KEY, now=fx.NOW)


def eat_token_seeds() -> list[bytes]:
    header = json.dumps({"alg": "ES256", "typ": "JWT", "kid": "fuzz-es256"}, separators=(",", ":")).encode()
    return [header + b"\n" + json.dumps(fx.claims(), separators=(",", ":")).encode(),
            header + b"\n" + json.dumps(fx.claims(nonce=b64url(fx.NONCE), dbgstat=2), separators=(",", ":")).encode()]


def eat_token_strategy(seeds: Sequence[Any]) -> st.SearchStrategy[bytes]:
    pairs = [s.partition(b"\n") for s in seeds if b"\n" in s]
    return st.one_of(
        st.builds(lambda hc, c: hc[0] + b"\n" + c, st.sampled_from(pairs), mutated_json([p[2] for p in pairs])),
        st.builds(lambda hc, h: h.replace(b"\n", b"") + b"\n" + hc[2], st.sampled_from(pairs),
                  mutated_json([p[0] for p in pairs])),
        mutated_bytes(seeds),
    )


def decode_evidence(data: bytes) -> object:
    """Evidence JSON from a party, through the relying party's whole admission flow."""
    return fx.gate().admit(fx.SITE, parse_evidence(data), public_key=fx.ATTESTED_KEY, now=fx.NOW)


def evidence_seeds() -> list[bytes]:
    iss = fx.issuer()
    common = {"attester": fx.SITE, "nonce": b64url(fx.NONCE), "public_key": b64url(fx.ATTESTED_KEY)}
    out = []
    for alg in ("ES256", "EdDSA"):
        key, kid = iss.key(alg)
        token = jws.sign_jws(fx.claims(), key, alg, kid)
        out.append(Evidence(format="eat-jwt", payload=token, **common).model_dump_json().encode())
    out += [Evidence(format="insecure-dev", payload=b64url(s), **common).model_dump_json().encode()
            for s in insecure_dev_seeds()]
    return out


def decode_insecure_dev(data: bytes) -> object:
    ev = Evidence(format="insecure-dev", attester=fx.SITE, nonce=b64url(fx.NONCE), public_key=b64url(fx.ATTESTED_KEY),
                  payload=b64url(data))
    return fx._verifiers()[1].verify(ev, nonce=fx.NONCE, now=fx.NOW)


def insecure_dev_seeds() -> list[bytes]:
    from crypto.attestation.models import key_hash

    now = fx.NOW.timestamp()
    body = {"nonce": b64url(fx.NONCE), "key_hash": b64url(key_hash(fx.ATTESTED_KEY)),
            "measurements": {"measurement": "a1" * 48}, "debug": False, "iat": now - 5, "exp": now + 300}
    return [json.dumps(body).encode()]


def decode_jwks(data: bytes) -> object:
    return jws.Jwks.from_json(data)


def jwks_seeds() -> list[bytes]:
    return [json.dumps(fx.issuer().jwks_doc).encode()]


# -- PKI ------------------------------------------------------------------------------------------


def decode_registry(data: bytes) -> object:
    return parse_signed_registry(data, fx.pki_ca())


def decode_manifest(data: bytes) -> object:
    return parse_manifest(data)


def decode_crl(data: bytes) -> object:
    return parse_verified_crl(data, fx.pki_ca())


def decode_trust_store(data: bytes) -> object:
    """A bundle whose one file (chosen by the first byte) is the input; the others are genuine."""
    if not data:
        data = b"\x00"
    bundle = fx.PKI_BUNDLES[data[0] % 2]
    name = fx.PKI_FILES[(data[0] >> 1) % len(fx.PKI_FILES)]
    files = dict(fx.pki_files()[bundle])
    files[name] = data[1:]
    return TrustStore.from_files(files.get, source=f"fuzzed {bundle} bundle")


def trust_store_seeds() -> list[bytes]:
    return [bytes([(i << 1) | j]) + fx.pki_files()[b][f] for j, b in enumerate(fx.PKI_BUNDLES)
            for i, f in enumerate(fx.PKI_FILES)]


def pem_strategy(seeds: Sequence[Any]) -> st.SearchStrategy[bytes]:
    """PEM text edits and edits of the DER inside it (length fields of ASN.1 included)."""
    import base64

    def der_edit(pem: bytes, program: bytes) -> bytes:
        lines = pem.strip().splitlines()
        der = apply_byte_program(base64.b64decode(b"".join(lines[1:-1])), program, [])
        body = base64.encodebytes(der)
        return lines[0] + b"\n" + body + lines[-1] + b"\n"

    pems = [s for s in seeds if s.startswith(b"-----BEGIN")]
    if not pems:
        return mutated_bytes(seeds)
    return st.one_of(st.builds(der_edit, st.sampled_from(pems), PROGRAM), mutated_bytes(seeds))


def trust_store_strategy(seeds: Sequence[Any]) -> st.SearchStrategy[bytes]:
    by_kind = [s for s in seeds if len(s) > 1]
    json_like = [s for s in by_kind if s[1:2] == b"{"]
    return st.one_of(
        st.builds(lambda sel, body: bytes([sel]) + body, st.integers(0, 255),
                  mutated_json([s[1:] for s in json_like])),
        st.builds(lambda s, body: s[:1] + body, st.sampled_from(by_kind),
                  pem_strategy([s[1:] for s in by_kind if s[1:2] == b"-"])),
        mutated_bytes(seeds),
    )

