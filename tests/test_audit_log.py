"""The audit log (crypto/audit) with provisioned keys: a log verifies, continues across writers, and
every kind of tampering is caught by `sovfl audit verify` or `sovfl audit compare`, naming the entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crypto.audit import AuditLog, AuditLogError, compare, digest_of, verify
from crypto.audit.verify import expected_key
from crypto.pki import CoordinatorBundle, SiteBundle, provision
from crypto.pki.keys import public_key_fingerprint
from federation.ops.cli import main


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    provision(root, ["site-a", "site-b"])
    return root


def _pair(pki: Path, tmp: Path) -> tuple[Path, Path]:
    """A coordinator's and site-a's logs of one run of two rounds, heads witnessed both ways."""
    cb, sb = CoordinatorBundle.load(pki / "coordinator"), SiteBundle.load(pki / "sites" / "site-a")
    coord = AuditLog(tmp / "coord", cb.sign_key, cb.name, "coordinator")
    site = AuditLog(tmp / "site", sb.sign_key, sb.name, "site",
                    {"coordinator_key": public_key_fingerprint(sb.coordinator_sign_public)})
    coord.append("run_started", run=7, site_keys={"site-a": public_key_fingerprint(sb.sign_key.public_key())})
    for rnd in (1, 2):
        digest = digest_of(f"update {rnd}")
        site.append("round_accepted", run=7, round=rnd)
        head = site.append("update_sent", run=7, round=rnd, digest=digest)
        coord.append("update_received", site="site-a", run=7, round=rnd, digest=digest)
        ch = coord.append("witness", party="site-a", **head.as_dict())
        site.append("witness", party="coordinator", **ch.as_dict())
    return tmp / "coord", tmp / "site"


def _lines(d: Path) -> list[str]:
    return (d / "audit.jsonl").read_text().splitlines(keepends=True)


def _write(d: Path, lines: list[str]) -> None:
    (d / "audit.jsonl").write_text("".join(lines))


def test_logs_verify_and_agree(pki, tmp_path, capsys):
    coord, site = _pair(pki, tmp_path)
    assert verify(coord).ok and verify(site).ok
    assert compare(verify(coord), verify(site)) == []
    assert main(["audit", "verify", str(site), "--bundle", str(pki / "coordinator")]) == 0
    assert main(["audit", "verify", str(coord), "--bundle", str(pki / "sites" / "site-a")]) == 0
    assert main(["audit", "compare", str(coord), str(site)]) == 0
    assert "consistent" in capsys.readouterr().out


def test_a_second_writer_continues_the_chain_and_another_key_cannot(pki, tmp_path):
    sb = SiteBundle.load(pki / "sites" / "site-a")
    AuditLog(tmp_path, sb.sign_key, "site-a", "site").append("a", x=1)
    again = AuditLog(tmp_path, sb.sign_key, "site-a", "site")
    head = again.append("b", x=2)
    v = verify(tmp_path)
    assert v.ok and head.index == 2 == v.head.index and head.hash == v.head.hash == again.head().hash
    other = SiteBundle.load(pki / "sites" / "site-b")
    with pytest.raises(AuditLogError, match="another key"):
        AuditLog(tmp_path, other.sign_key, "site-a", "site")


@pytest.mark.parametrize("which", ["coord", "site"])
def test_an_edited_value_is_caught_by_its_entry(pki, tmp_path, capsys, which):
    dirs = dict(zip(("coord", "site"), _pair(pki, tmp_path)))
    lines = _lines(dirs[which])
    entry = json.loads(lines[3])
    entry["fields"]["digest" if "digest" in entry["fields"] else "index"] = "sha256:" + "0" * 64
    lines[3] = json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n"
    _write(dirs[which], lines)
    v = verify(dirs[which])
    assert not v.ok and v.bad == 3 and "signature does not verify" in v.problem
    assert main(["audit", "verify", str(dirs[which])]) == 1
    assert "entry 3:" in capsys.readouterr().err


def test_a_deleted_line_and_swapped_lines_are_caught(pki, tmp_path):
    coord, site = _pair(pki, tmp_path)
    lines = _lines(site)
    _write(site, lines[:2] + lines[3:])
    v = verify(site)
    assert not v.ok and v.bad == 2 and "deleted, inserted or moved" in v.problem
    lines[4], lines[5] = lines[5], lines[4]
    _write(site, lines)
    v = verify(site)
    assert not v.ok and v.bad == 4 and "holds entry 5" in v.problem


def test_a_truncated_tail_is_caught_by_compare(pki, tmp_path, capsys):
    coord, site = _pair(pki, tmp_path)
    _write(site, _lines(site)[:-3])  # whole entries cut: the chain alone still holds
    assert verify(site).ok
    problems = compare(verify(coord), verify(site))
    assert any("witnessed site-a's head 5" in p and "cut off" in p for p in problems)
    assert any("round 2 from site-a" in p and "does not say it sent" in p for p in problems)
    assert main(["audit", "compare", str(coord), str(site)]) == 1
    assert "coordinator entry" in capsys.readouterr().err


def test_a_torn_last_line_is_reported_then_recorded_by_the_next_writer(pki, tmp_path):
    coord, site = _pair(pki, tmp_path)
    path = site / "audit.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"i":7,"t":1.0,"kind":"upd')  # a writer killed mid-line
    v = verify(site)
    assert not v.ok and v.bad == 7 and "torn last line after entry 6" in v.problem
    sb = SiteBundle.load(pki / "sites" / "site-a")
    AuditLog(site, sb.sign_key, "site-a", "site").append("resumed")
    v = verify(site)
    assert v.ok and [e["kind"] for e in v.entries[-2:]] == ["torn_tail", "resumed"]
    assert v.entries[-2]["fields"]["bytes"] == 26 and v.entries[-2]["fields"]["offset"] == len(whole)


def test_a_log_resigned_by_another_key_is_caught(pki, tmp_path, capsys):
    coord, site = _pair(pki, tmp_path)
    forged = tmp_path / "forged"
    other = SiteBundle.load(pki / "sites" / "site-b")  # a validly provisioned key, but not site-a's
    log = AuditLog(forged, other.sign_key, "site-a", "site")
    for line in _lines(site)[1:]:
        e = json.loads(line)
        log.append(e["kind"], **e["fields"])
    assert verify(forged).ok  # consistent in itself
    v = verify(forged, expected_key(pki / "coordinator", "site-a"))
    assert not v.ok and v.bad == 0 and "re-signed by another key" in v.problem
    assert main(["audit", "verify", str(forged), "--bundle", str(pki / "coordinator")]) == 1
    assert "entry 0:" in capsys.readouterr().err
    problems = compare(verify(coord), verify(forged))
    assert any("registry names" in p for p in problems)
    assert any("witnessed site-a's entry" in p and "rewritten" in p for p in problems)


def test_an_update_digest_that_differs_is_named(pki, tmp_path):
    coord, site = _pair(pki, tmp_path)
    cb = CoordinatorBundle.load(pki / "coordinator")
    AuditLog(coord, cb.sign_key, cb.name, "coordinator").append(
        "update_received", site="site-a", run=7, round=3, digest=digest_of("x"))
    sb = SiteBundle.load(pki / "sites" / "site-a")
    AuditLog(site, sb.sign_key, "site-a", "site").append("update_sent", run=7, round=3, digest=digest_of("y"))
    problems = compare(verify(coord), verify(site))
    assert len(problems) == 1 and "round 3 sent as" in problems[0] and "coordinator's entry 6" in problems[0]


def test_export_page_names_parties_rounds_refusals_and_digests(pki, tmp_path):
    coord, site = _pair(pki, tmp_path)
    cb = CoordinatorBundle.load(pki / "coordinator")
    log = AuditLog(coord, cb.sign_key, cb.name, "coordinator")
    log.append("round_started", run=7, round=1, group=["site-a", "site-b"])
    log.append("round_closed", run=7, round=1, aggregated=["site-a"], failed={"site-b": "site_error: policy_codec: x"},
               aggregate_digest=digest_of("mean"))
    sb = SiteBundle.load(pki / "sites" / "site-b")
    refused = AuditLog(tmp_path / "site-b", sb.sign_key, "site-b", "site")
    refused.append("round_refused", run=7, round=1, code="policy_codec", why="x")
    out = tmp_path / "audit.md"
    assert main(["audit", "export", str(coord), str(site), str(tmp_path / "site-b"), "-o", str(out)]) == 0
    page = out.read_text()
    assert "## Run 7" in page and "| site-a | `sha256:" in page
    assert f"| 1 | site-a, site-b | site-a | site-b: site_error: policy_codec: x | `{digest_of('mean')}` |" in page
    assert "| site-b | 1 | refused: policy_codec |" in page
    assert f"| site-a | 1 | accepted | `{digest_of('update 1')}` |" in page
    assert "every update digest and witnessed head agrees" in page and page.count("| yes |") == 3
