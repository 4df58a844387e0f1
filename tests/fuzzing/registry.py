"""Every decoder that reads another party's bytes, one line each; both fuzz runners use this list.

To add one (README.md in this folder): write `decode(input) -> object` that makes the real call,
register it here with its documented rejection type, and give it seeds: a `seeds=` callable over
the real encoder, and/or files in tests/fuzz_corpus/<name>/ (tests/fuzzing/make_corpus.py writes
them). The soak then prints its count; `make test` runs a few hundred of its inputs.
"""

from __future__ import annotations

from crypto.attestation import AttestationError
from crypto.envelope import EnvelopeError, EnvelopeHeader
from crypto.pki import PkiMaterialError
from crypto.secagg import SecAggAbort, SecAggError, SecAggMessageError

from . import config_targets as cfg
from . import crypto_targets as c
from . import protocol_targets as p
from .harness import REGISTRY, register
from .mutate import mutated_json


def _envelopes() -> list[bytes]:
    return [e.to_bytes() for e in c.envelope_seeds()]


def _framed() -> list[bytes]:
    return [c._frame(e.header, bytes(e.body)) for e in c.envelope_seeds()]


def _fields() -> list[tuple[object, object, object]]:
    return [(e.header, e.signature, bytes(e.body)) for e in c.envelope_seeds()]


def _sent(key: str) -> list[bytes]:
    from .fixtures import secagg_round

    return [secagg_round().sent[key]]


def _requested(key: str) -> list[bytes]:
    from .fixtures import secagg_round

    return [secagg_round().requests[key]]


def _relayed() -> list[bytes]:
    from .fixtures import secagg_round

    return [secagg_round().relayed]


def _signature() -> list[bytes]:
    from .fixtures import secagg_round

    sig = secagg_round().advert_sig
    return [c._frame(sig.header, sig.signature)]


def _share_envelopes() -> list[bytes]:
    from crypto.secagg import wire

    from .fixtures import ME, SECAGG_CTX, secagg_round

    _, relayed = wire.decode_masked_input_request(SECAGG_CTX, secagg_round().requests["masked_input"], ME)
    src = min(x.client for x in relayed)  # the neighbour whose channel key decode_share_envelope uses
    return [x.envelope for x in relayed if x.client == src]


def _pki(name: str) -> list[bytes]:
    from .fixtures import PKI_BUNDLES, pki_files

    return [pki_files()[b][name] for b in PKI_BUNDLES]


ENVELOPE = (EnvelopeError,)
SERVER = (SecAggMessageError,)  # the server rejects a client's message and goes on without it
CLIENT = (SecAggError,)  # a client ends its round (abort, config or message error) and says why
FINISH = (SecAggMessageError, SecAggAbort)  # the server's last reply, then unmasking: reject it, or abort

# name                              decoder                          rejection     seeds and strategy
register("envelope-header", EnvelopeHeader.decode, ENVELOPE,
         seeds=lambda: [e.header for e in c.envelope_seeds()])
register("envelope-blob", c.decode_envelope_blob, ENVELOPE, seeds=_envelopes, max_size=1 << 15)
register("envelope-signed", c.decode_envelope_signed, ENVELOPE, seeds=_framed, max_size=1 << 15)
register("envelope-fields", c.decode_envelope_fields, ENVELOPE, seeds=_fields, strategy=c.envelope_fields_strategy,
         load_seed=c.envelope_fields_seed, dump_seed=lambda f: c.Envelope(*f).to_bytes())
register("secagg-advert", c.decode_advert, SERVER, seeds=lambda: _sent("advert"), strategy=c.with_grammar("advert"))
register("secagg-plan", c.decode_plan, CLIENT, seeds=lambda: _requested("plan"), strategy=c.with_grammar("plan"))
register("secagg-setup", c.decode_setup, SERVER, seeds=lambda: _sent("setup"), strategy=c.with_grammar("setup"))
register("secagg-advert-signatures", c.decode_advert_signatures, SERVER, seeds=_relayed,
         strategy=c.with_grammar("advert_signatures"))
register("secagg-masked-input-request", c.decode_masked_input_request, CLIENT, seeds=lambda: _requested("masked_input"),
         strategy=c.with_grammar("masked_input_request"))
register("secagg-share-envelope", c.decode_share_envelope, SERVER, seeds=_share_envelopes)
register("secagg-share-plaintext", c.decode_share_plaintext, CLIENT, seeds=c.share_plaintext_seeds,
         strategy=c.share_plaintext_strategy)
register("secagg-masked-chunk", c.decode_masked_chunk, SERVER, seeds=c.masked_chunk_seeds)
register("secagg-packed-words", c.decode_packed_words, (ValueError,), seeds=c.packed_words_seeds)
register("secagg-unmask-request", c.decode_unmask_request, CLIENT, seeds=lambda: _requested("unmask"),
         strategy=c.with_grammar("unmask_request"))
register("secagg-unmask-reply", c.decode_unmask_reply, FINISH, seeds=lambda: _sent("unmask"),
         strategy=c.with_grammar("unmask_reply"))
register("secagg-signature", c.decode_secagg_signature, SERVER, seeds=_signature)
register("attestation-jws", c.decode_jws, AttestationError, seeds=c.jws_seeds, strategy=c.jws_strategy)
register("attestation-eat-claims", c.decode_eat_token, AttestationError, seeds=c.eat_token_seeds,
         strategy=c.eat_token_strategy)
register("attestation-evidence", c.decode_evidence, AttestationError, seeds=c.evidence_seeds, strategy=mutated_json)
register("attestation-insecure-dev", c.decode_insecure_dev, AttestationError, seeds=c.insecure_dev_seeds,
         strategy=mutated_json)
register("attestation-jwks", c.decode_jwks, AttestationError, seeds=c.jwks_seeds, strategy=mutated_json)
register("pki-registry", c.decode_registry, PkiMaterialError, seeds=lambda: _pki("registry.json"),
         strategy=mutated_json)
register("pki-manifest", c.decode_manifest, PkiMaterialError, seeds=lambda: _pki("manifest.json"),
         strategy=mutated_json)
register("pki-crl", c.decode_crl, PkiMaterialError, seeds=lambda: _pki("crl.pem"), strategy=c.pem_strategy)
register("pki-trust-store", c.decode_trust_store, PkiMaterialError, seeds=c.trust_store_seeds,
         strategy=c.trust_store_strategy)
register("config-yaml", cfg.decode_yaml, cfg.config_error(), seeds=cfg.yaml_seeds, strategy=cfg.yaml_strategy,
         known=cfg.known_failure)
register("config-document", cfg.decode_doc, cfg.config_error(), seeds=cfg.doc_seeds, strategy=cfg.doc_strategy,
         known=cfg.known_failure, load_seed=cfg.doc_from_corpus, dump_seed=cfg.doc_to_corpus)

# federation/protocol: the records one side of a round reads from the other (protocol_targets.py)
_REFUSED = (p.FlowerRefused,)  # bytes Flower's own deserializer refuses never reach our code


def _protocol_rejects(*types: type[BaseException]) -> tuple[type[BaseException], ...]:
    return (*types, *_REFUSED)


def _register_protocol() -> None:
    from crypto.secagg import SecAggMessageError
    from federation.protocol.codecs import CodecError
    from federation.protocol.downlink_steps import DownlinkError
    from federation.protocol.pipeline import UpdateRejected
    from federation.protocol.round_config import RoundConfigError

    records = p.records_strategy
    register("update-record", p.decode_update_record, _protocol_rejects(UpdateRejected), seeds=p.update_record_seeds,
             strategy=records)
    register("codec-payload", p.decode_codec_payload, _protocol_rejects(CodecError, UpdateRejected),
             seeds=p.codec_payload_seeds, strategy=records)
    register("codec-spec", p.decode_codec_spec, CodecError, seeds=p.codec_spec_seeds, max_size=256)
    register("envelope-layout", p.decode_envelope_layout, UpdateRejected, seeds=p.envelope_layout_seeds,
             strategy=p.envelope_layout_strategy)
    register("downlink-record", p.decode_downlink_record, _protocol_rejects(DownlinkError, UpdateRejected),
             seeds=p.downlink_seeds, strategy=records)
    register("round-config", p.decode_round_config, _protocol_rejects(RoundConfigError), seeds=p.round_config_seeds,
             strategy=records)
    register("status-record", p.decode_status_record, _protocol_rejects(UpdateRejected), seeds=p.status_record_seeds,
             strategy=records)
    register("secagg-request", p.decode_secagg_request, _protocol_rejects(SecAggMessageError),
             seeds=p.secagg_request_seeds, strategy=records)
    register("secagg-reply", p.decode_secagg_reply, _protocol_rejects(SecAggMessageError), seeds=p.secagg_reply_seeds,
             strategy=records)



def _register_bulk() -> None:
    from federation.protocol.bulk import BulkRefused

    from . import bulk_targets as b

    register("bulk-ref", b.decode_bulk_ref, BulkRefused, seeds=b.bulk_ref_seeds, strategy=mutated_json, max_size=4096)
    register("bulk-begin", b.decode_bulk_begin, BulkRefused, seeds=b.bulk_begin_seeds, strategy=mutated_json)
    register("bulk-get-header", b.decode_bulk_get_header, BulkRefused, seeds=b.bulk_get_header_seeds,
             strategy=mutated_json)
    register("bulk-chunk", b.decode_bulk_chunk, BulkRefused, seeds=b.bulk_chunk_seeds, max_size=1 << 18)
    register("bulk-refs", b.decode_bulk_refs, _protocol_rejects(BulkRefused), seeds=b.bulk_refs_seeds)
    from federation.protocol.link_probe import LinkProbeError

    register("link-probe-report", b.decode_link_probe_report, LinkProbeError, seeds=b.link_probe_report_seeds,
             strategy=mutated_json, max_size=4096)


_register_protocol()
_register_bulk()

__all__ = ["REGISTRY"]
