"""The per-document cache (re-runs scrub only what changed), dry runs, the report's contents, and
documents that cannot be scrubbed (dropped and named, never passed on)."""

from __future__ import annotations

import json
import time

import pytest

from site_trainer.pii import CorpusScrubber, PiiConfig, round_metrics, run_scrub
from site_trainer.pii.recognizers import Detector

VALUES = ["jean.dupont@orange.fr", "FR14 5957 4890 6828 8360 7598 386", "4111 1111 1111 1111", "81.2.69.160",
          "+33 1 43 38 83 68", "1 84 12 76 451 089 46"]


def _corpus(root, n=5):
    root.mkdir()
    for i in range(n):
        (root / f"f{i}.txt").write_text(
            f"Document {i}. Écrivez à {VALUES[0]} ; IBAN {VALUES[1]}.\nCarte {VALUES[2]} depuis {VALUES[3]}.\n"
            f"Téléphone {VALUES[4]}, NIR {VALUES[5]}.\n" + "Texte sans donnée personnelle.\n" * 20)
    (root / "clean.txt").write_text("Nothing personal here, only prose.\n" * 30)
    return sorted(root.iterdir())


def test_rerun_scrubs_only_changed_files(tmp_path):
    files = _corpus(tmp_path / "data")
    cache = tmp_path / "cache"
    first = run_scrub(files, PiiConfig(), cache_dir=cache, report_dir=None, out_dir=tmp_path / "out1")
    assert first.documents == 6 and first.documents_cached == 0 and first.documents_touched == 5
    assert first.counts["EMAIL_ADDRESS"] == 5 and first.counts["FR_NIR"] == 5
    second = run_scrub(files, PiiConfig(), cache_dir=cache, report_dir=None, out_dir=tmp_path / "out2")
    assert second.documents_cached == 6 and second.bytes_scanned == 0
    assert second.counts == first.counts
    for f in files:  # the cache gives back exactly what scrubbing gave
        assert (tmp_path / "out1" / f.name).read_text() == (tmp_path / "out2" / f.name).read_text()
    files[2].write_text(files[2].read_text() + "Nouvelle adresse : anna.muller@gmx.de\n")
    third = run_scrub(files, PiiConfig(), cache_dir=cache, report_dir=None)
    assert third.documents_cached == 5 and third.bytes_scanned == files[2].stat().st_size
    assert third.counts["EMAIL_ADDRESS"] == 6
    # another configuration is another fingerprint: nothing is reused
    other = run_scrub(files, PiiConfig(action="drop_document"), cache_dir=cache, report_dir=None)
    assert other.documents_cached == 0 and other.documents_dropped == 5


def test_transform_reads_what_scrub_wrote(tmp_path):
    """`sovfl scrub` fills the cache; the data path's transform then serves from it."""
    files = _corpus(tmp_path / "data", n=2)
    run_scrub(files, PiiConfig(), cache_dir=tmp_path / "cache", report_dir=None)
    scrub = CorpusScrubber(PiiConfig(), cache_dir=tmp_path / "cache")

    def no_scrubbing(*a, **k):
        raise AssertionError("scrubbed again despite the cache")

    scrub._engine.scrubber.scrub = no_scrubbing
    for f in files:
        out = scrub(str(f), f.read_text())
        assert out is not None and all(v not in out for v in VALUES)
    assert scrub.finish().documents_cached == 3


def test_dry_run_writes_only_the_report(tmp_path):
    files = _corpus(tmp_path / "data", n=2)
    report = run_scrub(files, PiiConfig(action="replace"), cache_dir=tmp_path / "cache",
                       report_dir=tmp_path / "report", out_dir=tmp_path / "out", dry_run=True)
    assert report.dry_run and report.counts["IBAN_CODE"] == 2
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["report.html", "report.json"]
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "report").iterdir()} == {0o600}


def test_report_holds_no_value_and_metrics_only_counts(tmp_path):
    files = _corpus(tmp_path / "data")
    report = run_scrub(files, PiiConfig(), cache_dir=tmp_path / "cache", report_dir=tmp_path / "report",
                       site="paris")
    written = (tmp_path / "report" / "report.json").read_text() + (tmp_path / "report" / "report.html").read_text()
    cached = "".join(p.read_text() for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.suffix in (".json", ".txt"))
    for v in VALUES:
        for part in (v, v.replace(" ", "")):
            assert part not in written and part not in cached, part
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    s = doc["samples"]["CREDIT_CARD"][0]
    assert s["shape"] == "9999 9999 9999 9999" and s["path"].endswith(".txt") and s["line"] == 2
    assert "<IP_ADDRESS>" in s["after"]  # other findings in the context are redacted too
    assert doc["site"] == "paris" and doc["documents_touched"] == 5
    m = round_metrics(report)
    assert m == {e: report.counts.get(e, 0) for e in PiiConfig().entities}
    assert all(type(k) is str and type(v) is int for k, v in m.items())
    assert m["EMAIL_ADDRESS"] == 5 and m["DE_TAX_ID"] == 0


class _Boom(Detector):
    entity, trigger = "BOOM", r"BOOM"

    def find(self, text):
        raise RuntimeError(f"bug while reading {text[:20]}")


class _Slow(Detector):
    entity, trigger = "SLOW", r"SLOW"

    def find(self, text):
        time.sleep(30)
        return []


def boom(config):
    return _Boom()


def slow(config):
    return [_Slow()]


def test_a_document_that_cannot_be_scrubbed_is_dropped_and_named(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.txt").write_text("mail jean.dupont@orange.fr\n")
    (data / "bad.txt").write_text("BOOM jean.dupont@orange.fr\n")
    (data / "slow.txt").write_text("SLOW 4111 1111 1111 1111\n")
    (data / "adir.txt").mkdir()  # unreadable as a file
    cfg = PiiConfig(recognizers=[f"{__name__}:boom", f"{__name__}:slow"], doc_timeout_s=0.5)
    scrub = CorpusScrubber(cfg, cache_dir=tmp_path / "cache")
    out = {p: scrub(p, (data / p).read_text()) for p in ("ok.txt", "bad.txt", "slow.txt")}
    assert out["ok.txt"] == "mail <EMAIL_ADDRESS>\n"
    assert out["bad.txt"] is None and out["slow.txt"] is None
    errors = {e["path"]: e["error"] for e in scrub.finish().errors}
    assert "RuntimeError" in errors["bad.txt"] and "orange" not in errors["bad.txt"]
    assert "doc_timeout_s=0.5" in errors["slow.txt"]
    report = run_scrub(sorted(data.iterdir()), cfg, cache_dir=tmp_path / "cache", report_dir=None)
    assert {e["path"].rsplit("/", 1)[-1] for e in report.errors} == {"bad.txt", "slow.txt", "adir.txt"}
    assert report.documents == 1  # ok.txt; the others are errors, not documents


def test_missing_plugin_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot be imported"):
        CorpusScrubber(PiiConfig(recognizers=["no_such_module:factory"]))
    with pytest.raises(ValueError, match="sovereign_fl.pii_recognizers"):
        CorpusScrubber(PiiConfig(recognizers=["not-installed"]))
