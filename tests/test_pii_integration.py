"""The PII scrubber in the site's text data path, in one process: `sites[].pii` -> the transforms the
framework gives a text task -> the token cache (scrubbed before tokenization, cached, counts restored
on reuse) -> the counts in the round's metrics; non-text tasks never load Presidio; `sovfl scrub`.
The federation run is tests/test_e2e_pii.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, write_config
from federation.config.schema import ConfigError, load_config
from federation.ops import cli
from hf_models import tiny_gpt2
from pii_corpus import SEEDED_PII, leak_forms, write_seeded_site
from site_trainer.config import SiteConfig
from site_trainer.pii import PATTERN_ENTITIES, transform
from site_trainer.tasks.hf_causal_lm import CausalLM, Options
from site_trainer.workload import TaskContext

SEEDED = {form for site in SEEDED_PII.values() for vs in site.values() for v in vs for form in leak_forms(v)}


class Recorder:
    """A user's document transform (options.transforms): records what it is given, changes nothing."""

    fingerprint = "recorder-1"
    seen: list[str] = []

    def __call__(self, path: str, text: str) -> str:
        Recorder.seen.append(text)
        return text


RECORDER = Recorder()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, write_seeded_site(root, "paris")


def build(model: Path, root: Path, work: Path, site: SiteConfig, **options):
    opts = Options.model_validate({"model_dir": str(model), "data": [str(root / "{site}" / "*")], "seq_len": 16,
                                   "val_fraction": 0.3, **options})
    transforms = transform.site_transforms(site.pii, CausalLM, work, site.id)
    task = CausalLM(opts, TaskContext(role="site", site=site.id, workdir=work, document_transforms=transforms))
    task.build_data()
    return task, transforms


def decoded(task: CausalLM) -> str:
    """Every token the cache holds (both splits), decoded: what any trainer rank can read."""
    cache = task.token_cache
    out = []
    for split, info in cache.index["splits"].items():
        ids = np.fromfile(cache.path / info["file"], dtype=np.dtype(cache.index["dtype"]))
        out.append(task.tokenizer.decode(ids.tolist()))
    return "\n".join(out)


def test_default_is_on_pattern_entities_mask_and_yaml_overrides(tmp_path):
    site = SiteConfig(id="paris", partition=0)
    assert site.pii.enabled and site.pii.action == "mask" and site.pii.entities == tuple(PATTERN_ENTITIES)
    base = {"federation": {"name": "p", "rounds": 1}, "workload": {"task": "digits"}}
    cfg = load_config(write_config(tmp_path / "ok.yaml", {**base, "sites": [
        {"id": "a", "partition": 0, "pii": {"entities": ["email_address", "IBAN_CODE"], "action": "replace"}},
        {"id": "b", "partition": 1, "pii": {"enabled": False}}]}))
    assert cfg.sites[0].pii.entities == ("EMAIL_ADDRESS", "IBAN_CODE") and cfg.sites[0].pii.action == "replace"
    assert not cfg.sites[1].pii.enabled
    with pytest.raises(ConfigError, match="ner_model"):
        load_config(write_config(tmp_path / "bad.yaml", {**base, "sites": [
            {"id": "a", "partition": 0, "pii": {"entities": ["PERSON"]}}]}))
    with pytest.raises(ConfigError, match="unknown PII entities"):
        load_config(write_config(tmp_path / "bad2.yaml", {**base, "sites": [
            {"id": "a", "partition": 0, "pii": {"entities": ["SHOE_SIZE"]}}]}))


def test_non_text_tasks_never_load_presidio():
    """A digits site gets no transform, and neither it nor the coordinator's metrics path imports Presidio."""
    code = ("import sys\n"
            "from site_trainer.config import SiteConfig\n"
            "from site_trainer.pii import transform\n"
            "from site_trainer.tasks.digits import Digits\n"
            "import federation.coordinator.strategy\n"
            "assert transform.site_transforms(SiteConfig(id='a', partition=0).pii, Digits, None, 'a') == ()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('presidio', 'spacy'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_config_to_transforms_to_token_cache(model, corpus, tmp_path):
    """The default scrubber runs before tokenization and before the user's transforms; no seeded
    value is in any token; the counts are exact, and a reused cache (nothing scrubbed) restores them."""
    root, truth = corpus
    site = SiteConfig(id="paris", partition=0)
    Recorder.seen = []
    task, transforms = build(model, root, tmp_path / "work", site, transforms=["test_pii_integration:RECORDER"])
    assert [type(t).__name__ for t in task.transforms] == ["ScrubTransform", "Recorder"]
    text = decoded(task)
    assert "<EMAIL_ADDRESS>" in text and "<IBAN_CODE>" in text and "<CREDIT_CARD>" in text
    squeezed = text.replace(" ", "").replace("-", "")
    assert not [v for v in SEEDED if v in text or v in squeezed]
    assert Recorder.seen and not [v for v in SEEDED if any(v in t for t in Recorder.seen)]
    metrics = transform.round_metrics(transforms)
    assert metrics == {f"pii_{e}": float(truth.get(e, 0)) for e in PATTERN_ENTITIES}
    assert transform.counts_from_metrics({**metrics, "loss": 1.5}) == {e: truth.get(e, 0) for e in PATTERN_ENTITIES}
    local = json.loads((transform.report_dir(tmp_path / "work") / "report.json").read_text())
    assert local["counts"] == {e: n for e, n in truth.items()} and local["documents"] == 6  # the site-local report
    index = json.loads((task.token_cache.path / "index.json").read_text())
    assert index["transform_reports"][transforms[0].fingerprint] == {e: truth.get(e, 0) for e in PATTERN_ENTITIES}

    again, transforms2 = build(model, root, tmp_path / "work", site, transforms=["test_pii_integration:RECORDER"])
    assert again.token_cache.path == task.token_cache.path
    assert transforms2[0].scrubber.report.documents == 0  # reused: not scrubbed again
    assert transform.round_metrics(transforms2) == metrics

    other = SiteConfig(id="paris", partition=0, pii={"action": "replace"})
    replaced, _ = build(model, root, tmp_path / "work", other)
    assert replaced.token_cache.path != task.token_cache.path  # the scrubber's fingerprint is in the key
    assert not [v for v in SEEDED if v in decoded(replaced)]


def test_disabled_pii_leaves_text_as_is(model, corpus, tmp_path):
    root, _ = corpus
    site = SiteConfig(id="paris", partition=0, pii={"enabled": False})
    task, transforms = build(model, root, tmp_path / "work", site)
    assert transforms == () and transform.round_metrics(transforms) == {}
    assert "jeanne.martin@banque-exemple.fr" in decoded(task)


def test_a_text_task_that_bypasses_the_scrubber_is_refused(tmp_path):
    t = transform.ScrubTransform(SiteConfig(id="a", partition=0).pii, tmp_path, "a")
    with pytest.raises(RuntimeError, match="never went through the site's PII scrubber"):
        transform.round_metrics([t], "task 'mine'")


def _scrub(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["scrub", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_sovfl_scrub(model, corpus, tmp_path, capsys):
    """Dry run: only the report; a real run fills the cache training then reads; clear refusals."""
    root, truth = corpus
    sites = [{"id": "paris", "partition": 0, "pii": {"workers": 1}},
             {"id": "lyon", "partition": 1}]
    wl = {"task": "hf-causal-lm", "options": {"model_dir": str(model), "data": [str(root / "{site}" / "*")],
                                              "seq_len": 16}}
    cfg = write_config(tmp_path / "c.yaml", {"federation": {"name": "p", "rounds": 1}, "workload": wl, "sites": sites})
    work = tmp_path / "site"

    rc, out, err = _scrub(capsys, str(cfg), "--site", "paris", "--dry-run", "--workdir", str(work))
    assert rc == 0, err
    pii_dir = work / "sites" / "paris" / "pii"
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file()) == [
        "sites/paris/pii/report/report.html", "sites/paris/pii/report/report.json"]  # nothing but the report
    report = json.loads((pii_dir / "report" / "report.json").read_text())
    for entity, n in truth.items():
        assert f"{entity:18s} {n:8d}" in out
    assert "DRY RUN" in out and "scrubbing 2 file(s)" in err and "  scrubbed 1 document(s)" in err
    written = (pii_dir / "report" / "report.json").read_text() + (pii_dir / "report" / "report.html").read_text()
    assert not [v for v in SEEDED if v in written + out + err]
    assert report

    rc, out, err = _scrub(capsys, str(cfg), "--site", "paris", "--workdir", str(work))
    assert rc == 0, err
    site = load_config(cfg).sites[0]
    task, transforms = build(model, root, work / "sites" / "paris", site)
    rep = transforms[0].scrubber.report
    assert rep.documents > 0 and rep.documents_cached == rep.documents  # training scrubbed nothing again

    rc, _, err = _scrub(capsys, str(cfg), "--site", "nice", "--workdir", str(work))
    assert rc == 2 and "no site 'nice'" in err and "paris" in err
    rc, _, err = _scrub(capsys, str(cfg), "--site", "lyon", "--workdir", str(work))
    assert rc == 2 and "matches no file" in err and "lyon" in err
    digits = write_config(tmp_path / "d.yaml", {"federation": {"name": "p", "rounds": 1}, "sites": sites})
    rc, _, err = _scrub(capsys, str(digits), "--site", "paris", "--workdir", str(work))
    assert rc == 2 and "does not read text" in err
