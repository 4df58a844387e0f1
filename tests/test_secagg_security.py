"""Security properties: masked vectors look uniform, shares are sealed, replays are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import secagg_to_stage3
from crypto.secagg import (
    MalformedMessageError,
    ProtocolViolationError,
    ReplayedMessageError,
    SecAggClient,
    SecAggConfig,
    SecAggMessageError,
    SecAggServer,
    TamperedMessageError,
    new_context,
)
from crypto.secagg import wire
from crypto.secagg.keys import KeyPair, share_channel_key

P = 4096


def _chi_square_p_value(counts: np.ndarray) -> float:
    """Upper-tail p-value of Pearson's statistic for uniform counts (scipy if present)."""
    expected = counts.sum() / counts.size
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.size - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty normal approximation of the chi-square tail
        import math

        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("bits", [8, 32])
def test_a_masked_vector_alone_is_uniform_over_the_ring(bits: int) -> None:
    cfg = SecAggConfig(threshold=2, clip=1.0, bits=bits, max_weight=1, chunk_bytes=1024)
    _, clients, srv = secagg_to_stage3(cfg, [1, 2, 3], P)
    x = np.full(P, 0.25, np.float32)  # a constant input: maximally non-uniform before masking
    words = np.concatenate([w.copy() for _, w in clients[1].masked_input(srv.masked_input_request(1), x, 1)])
    assert words.max() < 1 << bits
    top_byte = words >> np.uint32(bits - 8)  # 256 bins over the ring
    counts = np.bincount(top_byte, minlength=256)
    assert _chi_square_p_value(counts) > 1e-6  # false alarm once in a million runs
    plain = srv.params.codec.encode(x, 1, np.random.default_rng())
    assert _chi_square_p_value(np.bincount(plain >> np.uint32(bits - 8), minlength=256)) < 1e-9


def _stage3_request(cfg: SecAggConfig):  # type: ignore[no-untyped-def]
    ctx, clients, srv = secagg_to_stage3(cfg, [1, 2, 3, 4], P)
    return ctx, clients, srv, srv.masked_input_request(1)


CFG = SecAggConfig(threshold=2, clip=1.0, chunk_bytes=1024)


def _envelope(ctx, request: bytes, me: int, src: int) -> bytes:  # type: ignore[no-untyped-def]
    return next(x.envelope for x in wire.decode_masked_input_request(ctx, request, me)[1] if x.client == src)


def _replace_envelope(ctx, request: bytes, me: int, src: int, new_env: bytes) -> bytes:  # type: ignore[no-untyped-def]
    spec, relayed = wire.decode_masked_input_request(ctx, request, me)
    relayed = [wire.Relayed(x.client, x.s_pk, new_env) if x.client == src else x for x in relayed]
    return wire.encode_masked_input_request(ctx, me, spec, relayed)


def test_tampered_share_ciphertext_is_rejected() -> None:
    ctx, clients, _, req = _stage3_request(CFG)
    env = bytearray(_envelope(ctx, req, 1, 2))
    env[-20] ^= 0x01  # one bit of ciphertext
    with pytest.raises(TamperedMessageError, match="failed authentication"):
        clients[1].receive_shares(_replace_envelope(ctx, req, 1, 2, bytes(env)))


def test_tampered_header_is_rejected() -> None:
    """Changing the addressed pair to match another slot still fails: the header is AEAD data."""
    ctx, clients, _, req = _stage3_request(CFG)
    env = _envelope(ctx, req, 1, 3)
    hdr_len = len(wire._envelope_header(ctx, 3, 1))
    forged = wire._envelope_header(ctx, 2, 1) + env[hdr_len:]
    with pytest.raises(TamperedMessageError):
        clients[1].receive_shares(_replace_envelope(ctx, req, 1, 2, forged))


@pytest.mark.parametrize("other", ["earlier-round", "other-run"])
def test_replayed_share_envelope_is_rejected(other: str) -> None:
    ctx, clients, _, req = _stage3_request(CFG)
    old_ctx = new_context(ctx.run_id, ctx.round - 1) if other == "earlier-round" else new_context("other", ctx.round)
    # an envelope from client 2 to client 1 made in another round/run (with those rounds' keys)
    a, b = KeyPair.generate(), KeyPair.generate()
    old_env = wire.seal_envelope(share_channel_key(a.private, b.public, old_ctx, 2, 1), old_ctx, 2, 1, b"x" * 84)
    with pytest.raises(ReplayedMessageError, match="replayed"):
        clients[1].receive_shares(_replace_envelope(ctx, req, 1, 2, old_env))
    # the same old ciphertext under a forged current header fails authentication
    hdr_len = len(wire._envelope_header(old_ctx, 2, 1))
    forged = wire._envelope_header(ctx, 2, 1) + old_env[hdr_len:]
    with pytest.raises(TamperedMessageError):
        clients[1].receive_shares(_replace_envelope(ctx, req, 1, 2, forged))


def test_replayed_stage_messages_are_rejected() -> None:
    from crypto.secagg.simulation import make_plan

    cfg = SecAggConfig(threshold=2, clip=1.0)
    old, new = new_context("run", 1), new_context("run", 2)

    def setup(ctx, me=7, members=(7, 8, 9)):  # type: ignore[no-untyped-def]
        plan, channel = make_plan(cfg, ctx, list(members))
        return SecAggClient.setup(cfg, plan, me, channel[me])[1]

    srv = SecAggServer(cfg, make_plan(cfg, new, [7, 8, 9])[0], vector_len=10)
    with pytest.raises(ReplayedMessageError, match="round 1"):
        srv.receive_setup(7, setup(old))
    with pytest.raises(ReplayedMessageError, match="elsewhere"):
        srv.receive_setup(7, setup(new_context("elsewhere", 2)))
    good = setup(new)
    with pytest.raises(ReplayedMessageError):
        srv.receive_setup(8, good)  # client 8 relaying client 7's message
    with pytest.raises(ProtocolViolationError, match="envelopes to"):
        srv.receive_setup(7, setup(new, members=(7, 8)))  # made for another plan of this round
    srv.receive_setup(7, good)
    with pytest.raises(ProtocolViolationError):
        srv.receive_setup(7, good)  # duplicate


def test_a_client_never_reveals_both_secrets_of_a_neighbour() -> None:
    ctx, clients, srv = secagg_to_stage3(CFG, [1, 2, 3, 4], P)
    for i in [1, 2, 3, 4]:
        for off, w in clients[i].masked_input(srv.masked_input_request(i), np.zeros(P, np.float32), 1):
            srv.add_masked_chunk(i, off, w)
    srv.close_masked_input()
    both = wire.encode_unmask_request(ctx, 1, [1, 2, 3], [2])
    with pytest.raises(ProtocolViolationError, match="overlap"):
        clients[1].unmask(both)
    ok = srv.unmask_request(1)
    clients[1].unmask(ok)
    with pytest.raises(ProtocolViolationError):
        clients[1].unmask(wire.encode_unmask_request(ctx, 1, [1], [2, 3, 4]))  # a second request


def test_a_client_masks_only_once() -> None:
    _, clients, srv = secagg_to_stage3(CFG, [1, 2, 3], P)
    req = srv.masked_input_request(1)
    list(clients[1].masked_input(req, np.zeros(P, np.float32), 1))
    with pytest.raises(ProtocolViolationError):
        clients[1].masked_input(req, np.ones(P, np.float32), 1)


def test_a_nan_update_raises_at_its_chunk() -> None:
    _, clients, srv = secagg_to_stage3(CFG, [1, 2, 3], P)
    x = np.zeros(P, np.float32)
    x[-5] = np.nan  # in the last chunk: the earlier ones are yielded, the site never sends them
    with pytest.raises(ValueError, match="NaN"):
        for _ in clients[1].masked_input(srv.masked_input_request(1), x, 1):
            pass


def test_server_rejects_bad_chunks() -> None:
    cfg = SecAggConfig(threshold=2, clip=1.0, bits=16, chunk_bytes=1024)
    _, clients, srv = secagg_to_stage3(cfg, [1, 2, 3], P)
    off, w = next(iter(clients[1].masked_input(srv.masked_input_request(1), np.zeros(P, np.float32), 1)))
    srv.add_masked_chunk(1, off, w)
    with pytest.raises(ProtocolViolationError, match="overlapping"):
        srv.add_masked_chunk(1, off + 1, w)
    with pytest.raises(MalformedMessageError):
        srv.add_masked_chunk(1, P, w)  # runs past the end
    with pytest.raises(MalformedMessageError):
        srv.add_masked_chunk(1, 300, w.astype(np.int64))
    with pytest.raises(MalformedMessageError, match="ring"):
        srv.add_masked_chunk(1, 300, np.full(4, 1 << 20, np.uint32))
    with pytest.raises(ProtocolViolationError):
        srv.add_masked_chunk(99, 0, w)


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=300), prefix=st.sampled_from([b"", b"SAG2\x03", b"SAG2\x04\x03run"]))
def test_hostile_bytes_only_raise_message_errors(data: bytes, prefix: bytes) -> None:
    from crypto.secagg.simulation import make_plan

    cfg = SecAggConfig(threshold=2, clip=1.0)
    plan, channel = make_plan(cfg, new_context("run", 1), [1, 2, 3])
    srv = SecAggServer(cfg, plan, vector_len=4)
    with pytest.raises(SecAggMessageError):
        srv.receive_setup(1, prefix + data)
    client, _ = SecAggClient.setup(cfg, plan, 1, channel[1])
    with pytest.raises(SecAggMessageError):
        client.receive_shares(prefix + data)
