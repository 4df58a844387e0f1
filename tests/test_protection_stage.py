"""The signing/sealing stage between site and coordinator, with really provisioned keys."""

from __future__ import annotations

import numpy as np
import pytest

from crypto.envelope import ReplayGuard
from crypto.pki import CoordinatorBundle, SiteBundle, provision, revoke
from federation.protocol.pipeline import Payload, RoundContext, UpdateRejected
from federation.coordinator.envelope_opener import CoordinatorProtection
from federation.protocol.envelope_layout import pack, unpack
from federation.site.protection_mod import SiteProtection


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    out = tmp_path_factory.mktemp("pki")
    provision(out, ["a", "b", "gone"])
    revoke(out, "gone")
    return out


def _payload():
    return Payload({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "i": np.array([1, 5], np.int32),
                    "bf16": np.array([0x3F80, 0xBFC0], "<u2")},  # bfloat16 1.0, -1.5 as raw words
                   {"codec.codec": "identity", "n": 3})


def _coordinator(pki, sealed=False):
    return CoordinatorProtection(CoordinatorBundle.load(pki / "coordinator"), sealed, ReplayGuard())


@pytest.mark.parametrize("seal", [False, True])
def test_signed_and_sealed_roundtrip(pki, seal):
    ctx = RoundContext("f", 7, 2, "a")
    wire = SiteProtection(SiteBundle.load(pki / "sites" / "a"), seal).encode(_payload(), ctx)
    raw = _payload().arrays["w"].tobytes()
    assert (raw in wire.arrays["envelope"].tobytes()) is (not seal)  # sealed: the plaintext is gone
    back = _coordinator(pki, sealed=seal).decode(wire, ctx)
    np.testing.assert_array_equal(back.arrays["w"], _payload().arrays["w"])
    assert back.arrays["bf16"].dtype.str == "<u2" and back.arrays["bf16"].tolist() == [0x3F80, 0xBFC0]  # bit-exact
    assert back.meta == _payload().meta


def _reason(coord, wire, ctx) -> str:
    with pytest.raises(UpdateRejected) as err:
        coord.decode(wire, ctx)
    return err.value.reason


def test_each_rejection_has_its_own_reason(pki):
    a = SiteProtection(SiteBundle.load(pki / "sites" / "a"), False)
    ctx = RoundContext("f", 7, 3, "a")
    coord = _coordinator(pki)

    wire = a.encode(_payload(), ctx)
    wire.arrays["envelope"] = wire.arrays["envelope"].copy()
    wire.arrays["envelope"][0] ^= 1
    assert _reason(coord, wire, ctx) == "digest_mismatch"

    wire = a.encode(_payload(), ctx)
    sig = bytearray(wire.meta["envelope_signature"])
    sig[0] ^= 1
    wire.meta["envelope_signature"] = bytes(sig)
    assert _reason(coord, wire, ctx) == "bad_signature"

    gone = SiteProtection(SiteBundle.load(pki / "sites" / "gone"), False)
    assert _reason(coord, gone.encode(_payload(), RoundContext("f", 7, 3, "gone")),
                   RoundContext("f", 7, 3, "gone")) == "revoked_site"

    assert _reason(coord, a.encode(_payload(), RoundContext("f", 8, 3, "a")), ctx) == "wrong_run"
    assert _reason(coord, a.encode(_payload(), RoundContext("f", 7, 2, "a")), ctx) == "wrong_round"

    ok = a.encode(_payload(), ctx)
    coord.decode(ok, ctx)
    assert _reason(coord, ok, ctx) in ("replayed_round", "replayed_nonce")

    b_wire = SiteProtection(SiteBundle.load(pki / "sites" / "b"), False).encode(_payload(), RoundContext("f", 7, 4, "b"))
    assert _reason(coord, b_wire, RoundContext("f", 7, 4, "a")) == "wrong_site"  # b's envelope relayed as a's

    assert _reason(_coordinator(pki, sealed=True), a.encode(_payload(), RoundContext("f", 7, 5, "a")),
                   RoundContext("f", 7, 5, "a")) == "not_sealed"
    assert _reason(coord, Payload({"w": np.zeros(3, np.float32)}), ctx) == "unsigned"


def test_other_federation_is_rejected(pki, tmp_path):
    other = tmp_path / "other"
    provision(other, ["a"])
    ctx = RoundContext("f", 7, 1, "a")
    wire = SiteProtection(SiteBundle.load(other / "sites" / "a"), False).encode(_payload(), ctx)
    assert _reason(_coordinator(pki), wire, ctx) == "wrong_federation"


def test_layout_cannot_smuggle_objects():
    buf, layout = pack({"x": np.ones(2, np.float32)})
    layout[0][1] = "|O"
    with pytest.raises(UpdateRejected, match="not allowed"):
        unpack(buf, layout)
    layout[0][1], layout[0][2] = "<f4", [100]
    with pytest.raises(UpdateRejected, match="past the payload"):
        unpack(buf, layout)
