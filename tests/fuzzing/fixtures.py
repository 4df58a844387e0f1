"""The parties the crypto fuzz targets decode for: keys, trust stores, a SecAgg+ round frozen at
each stage, an attestation issuer. Built deterministically (fixed keys, randomness replaced by a
hash stream while a round is set up), so the committed corpus stays valid for them: a seed that
verified when tests/fuzzing/make_corpus.py wrote it verifies in every later run.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa, x25519

from crypto.attestation import AttestationGate, EatJwtVerifier, InsecureDevVerifier, Policy
from crypto.attestation.jose import Jwks, public_jwk
from crypto.attestation.testing import GOOD_MEASUREMENT
from crypto.pki import PartyRecord, TrustStore
from crypto.secagg import RoundContext, SecAggClient, SecAggConfig, SecAggServer, signing, wire

from .harness import CORPUS_DIR

FEDERATION = "fuzz-fed"
SITE = "site-a"
NOW = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)  # verifiers run at this instant
NONCE = hashlib.sha256(b"fuzz-challenge").digest()  # the verifier's challenge in every seed
ATTESTED_KEY = hashlib.sha256(b"fuzz-attested-key").digest()  # the key the evidence binds
ISSUER, AUDIENCE = "https://attestation.fuzz", "sovereign-fl"
PKI_DIR = CORPUS_DIR / "_fixtures" / "pki"


def _secret(label: str, n: int = 32) -> bytes:
    return hashlib.shake_256(b"sovfl-fuzz/" + label.encode()).digest(n)


@contextlib.contextmanager
def deterministic(label: str) -> Iterator[None]:
    """os.urandom, secrets.randbelow and X25519 key generation from a hash stream, for setup only."""
    counter = iter(range(1 << 62))

    def urandom(n: int) -> bytes:
        return hashlib.shake_256(f"{label}/{next(counter)}".encode()).digest(n) if n else b""

    def randbelow(bound: int) -> int:
        return int.from_bytes(urandom((bound.bit_length() + 7) // 8 + 16), "big") % bound

    def x25519_generate(cls: Any = None) -> x25519.X25519PrivateKey:
        return x25519.X25519PrivateKey.from_private_bytes(urandom(32))

    with mock.patch("os.urandom", urandom), mock.patch("secrets.randbelow", randbelow), \
            mock.patch.object(x25519.X25519PrivateKey, "generate", x25519_generate):
        yield


# -- envelopes --------------------------------------------------------------------------------


@functools.cache
def site_key(name: str = SITE) -> ed25519.Ed25519PrivateKey:
    return ed25519.Ed25519PrivateKey.from_private_bytes(_secret(f"sign/{name}"))


@functools.cache
def coordinator_seal_key() -> x25519.X25519PrivateKey:
    return x25519.X25519PrivateKey.from_private_bytes(_secret("seal/coordinator"))


@functools.cache
def trust_store(sites: tuple[str, ...] = (SITE,)) -> TrustStore:
    names = sites
    return TrustStore(FEDERATION, {n: PartyRecord(n, "site", site_key(n).public_key(), cert_serial=i + 1)
                                   for i, n in enumerate(names)})


# -- SecAgg+ ------------------------------------------------------------------------------------

SECAGG_CONFIG = SecAggConfig(threshold=3, neighbours="auto", clip=1.0, chunk_bytes=64)
SECAGG_CTX = RoundContext("fuzz-run", 3, _secret("graph-seed"))
CLIENTS = [2, 3, 5, 7, 11, 13]
ME = 5  # the client whose messages are fuzzed (as sender to the server, as receiver of requests)
VECTOR = 20


def site_of(client: int) -> str:
    return f"site-{client}"


@dataclass(frozen=True)
class SecAggRound:
    """One round frozen just before ME's message of each stage (server) or before ME handles the
    request of each stage (client), with ME's genuine messages as seeds. Stage 2 is the setup
    (Bonawitz et al.'s stages 1 and 2 in one message, sent one round ahead from the plan)."""

    server: dict[int, SecAggServer]  # stage -> server waiting for ME's message of that stage
    client_state: dict[int, bytes]  # stage -> ME's state when that stage's request arrives
    sent: dict[str, bytes]  # ME's genuine messages ("advert", "setup", "unmask")
    requests: dict[str, bytes]  # the server's genuine requests to ME ("plan", "masked_input", "unmask")
    relayed: bytes  # the neighbours' advert signatures relayed to ME with stage 3
    advert_sig: signing.Signature  # ME's signature over its advert
    chunks: list[tuple[int, np.ndarray]]  # ME's masked input (ring words)
    channel_keys: dict[int, bytes]  # neighbour -> AEAD key of the share channel with ME
    channel_private: bytes  # ME's long-term channel key (provisioned), for the plan
    trust: TrustStore

    def server_at(self, stage: int) -> SecAggServer:
        return copy.deepcopy(self.server[stage])

    def client_at(self, stage: int) -> SecAggClient:
        return SecAggClient.from_state(SECAGG_CONFIG, self.client_state[stage])


@functools.cache
def secagg_round() -> SecAggRound:
    from crypto.secagg import RoundPlan
    from crypto.secagg.keys import KeyPair

    cfg, ctx = SECAGG_CONFIG, SECAGG_CTX
    trust = trust_store(tuple(site_of(c) for c in CLIENTS))
    rng = np.random.default_rng(0)
    with deterministic("secagg-round"):
        channel = {c: KeyPair.generate() for c in CLIENTS}
        plan = RoundPlan.make(cfg, ctx, [wire.PlanMember(c, site_of(c), channel[c].public) for c in CLIENTS])
        server = SecAggServer(cfg, plan, VECTOR)
        made = {c: SecAggClient.setup(cfg, plan, c, channel[c].private) for c in CLIENTS}
        clients = {c: m[0] for c, m in made.items()}
        setups = {c: m[1] for c, m in made.items()}
        adverts = {c: clients[c].advert() for c in CLIENTS}
        sigs = {c: signing.sign(site_key(site_of(c)), FEDERATION, site_of(c), ctx, 1, adverts[c]) for c in CLIENTS}
        servers: dict[int, SecAggServer] = {}

        def deliver(stage: int, send: Any, mine: bool = True) -> None:
            """The other clients' messages of a stage, the server as it waits for ME's, then ME's."""
            for c in CLIENTS:
                if c != ME:
                    send(c)
            servers[stage] = copy.deepcopy(server)
            if mine:
                send(ME)

        deliver(2, lambda c: server.receive_setup(c, setups[c]))
        server.close_setup(weight_bound=10 + max(CLIENTS))
        states = {3: clients[ME].to_state()}
        masked_req = server.masked_input_request(ME)
        chunks: dict[int, list[tuple[int, np.ndarray]]] = {}
        for c in CLIENTS:
            x = rng.normal(0, 0.5, VECTOR).astype(np.float32)
            gen = clients[c].masked_input(server.masked_input_request(c), x, 10 + c, rng=np.random.default_rng(c))
            chunks[c] = [(off, words.copy()) for off, words in gen]
        deliver(3, lambda c: [server.add_masked_chunk(c, off, words) for off, words in chunks[c]])
        server.close_masked_input()
        states[4] = clients[ME].to_state()
        unmask_req = server.unmask_request(ME)
        unmask = {c: clients[c].unmask(server.unmask_request(c)) for c in CLIENTS}
        deliver(4, lambda c: server.receive_unmask(c, unmask[c]), mine=False)
        nbrs = plan.graph[ME]
        relayed = wire.encode_advert_signatures(ctx, ME, {v: (sigs[v].header, sigs[v].signature) for v in sorted(nbrs)})
        keys_with_me = {v: clients[ME]._channel[v] for v in nbrs}
    return SecAggRound(servers, states, {"advert": adverts[ME], "setup": setups[ME], "unmask": unmask[ME]},
                       {"plan": plan.encode(), "masked_input": masked_req, "unmask": unmask_req}, relayed,
                       sigs[ME], chunks[ME], keys_with_me, channel[ME].private, trust)


# -- attestation --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Issuer:
    """Token-signing keys of a (test) attestation service, and what the relying party trusts."""

    keys: dict[str, tuple[Any, str]]  # kid -> (private key, alg)
    jwks: Jwks
    jwks_doc: dict[str, Any]

    def key(self, alg: str) -> tuple[Any, str]:
        return next((k, kid) for kid, (k, a) in self.keys.items() if a == alg)


@functools.cache
def issuer() -> Issuer:
    es256 = ec.derive_private_key(int.from_bytes(_secret("issuer/es256"), "big"), ec.SECP256R1())
    es384 = ec.derive_private_key(int.from_bytes(_secret("issuer/es384", 48), "big"), ec.SECP384R1())
    eddsa = ed25519.Ed25519PrivateKey.from_private_bytes(_secret("issuer/eddsa"))
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)  # not in committed seeds
    keys = {"fuzz-es256": (es256, "ES256"), "fuzz-es384": (es384, "ES384"), "fuzz-eddsa": (eddsa, "EdDSA"),
            "fuzz-rs256": (rsa_key, "RS256"), "fuzz-ps256": (rsa_key, "PS256")}
    doc = {"keys": [public_jwk(k, kid, alg) for kid, (k, alg) in keys.items()]}
    return Issuer(keys, Jwks.from_dict(doc), doc)


def eat_verifier() -> EatJwtVerifier:
    return EatJwtVerifier({"jwks": issuer().jwks_doc, "issuer": ISSUER, "audience": AUDIENCE,
                           "algorithms": ["ES256", "ES384", "RS256", "PS256", "EdDSA"]})


def insecure_verifier() -> InsecureDevVerifier:
    return InsecureDevVerifier({"allow_insecure_dev": True})


POLICY = Policy(allowed_measurements={"measurement": [GOOD_MEASUREMENT]}, allow_insecure_dev=True)


def gate() -> AttestationGate:
    """A relying party that issued NONCE to SITE (one gate per input: a nonce is consumed once)."""
    g = AttestationGate({"eat-jwt": _verifiers()[0], "insecure-dev": _verifiers()[1]}, POLICY)
    g.nonces._issued[NONCE] = (SITE, NOW + dt.timedelta(minutes=5))  # as if g.challenge(SITE) had drawn it
    return g


@functools.cache
def _verifiers() -> tuple[EatJwtVerifier, InsecureDevVerifier]:
    return eat_verifier(), insecure_verifier()


def claims(**extra: Any) -> dict[str, Any]:
    from crypto.attestation.models import b64url, key_hash

    iat = int(NOW.timestamp()) - 10
    out = {"iss": ISSUER, "aud": AUDIENCE, "iat": iat, "nbf": iat, "exp": iat + 300, "eat_nonce": b64url(NONCE),
           "sovfl_key_hash": b64url(key_hash(ATTESTED_KEY)), "measurement": GOOD_MEASUREMENT,
           "dbgstat": "disabled-since-boot", "eat_profile": "tag:sovereign-fl,2025:fuzz"}
    out.update(extra)
    return out


# -- PKI ----------------------------------------------------------------------------------------

PKI_FILES = ("manifest.json", "registry.json", "crl.pem", "ca.crt")
PKI_BUNDLES = ("coordinator", "site-a")


@functools.cache
def pki_files() -> dict[str, dict[str, bytes]]:
    """bundle -> file -> bytes: public files of a provisioned federation (tests/fuzz_corpus/_fixtures)."""
    return {b: {f: (PKI_DIR / b / f).read_bytes() for f in PKI_FILES} for b in PKI_BUNDLES}


@functools.cache
def pki_ca() -> x509.Certificate:
    return x509.load_pem_x509_certificate(pki_files()["coordinator"]["ca.crt"])


def pki_dir() -> Path:
    return PKI_DIR
