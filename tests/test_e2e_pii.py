"""End to end: the Hugging Face task federated over two sites whose raw files hold seeded PII
(e-mails, IBANs, phone numbers, cards). Every token any trainer rank can read is decoded and
searched; the wire between the sites and the SuperLink (recorded, TLS off), metrics.jsonl, the
logs and every file the run wrote are searched too; the round's metrics line carries the exact
counts per entity type."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import live_marked, write_config
from federation.ops import launcher
from hf_models import tiny_gpt2
from pii_corpus import SEEDED_PII, leak_forms, write_seeded_site
from site_trainer.pii import PATTERN_ENTITIES
from wiretap import WireTap

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=70)]

SEEDED = sorted({form for site in SEEDED_PII.values() for vs in site.values() for v in vs for form in leak_forms(v)})


def _decoded_caches(site_dir: Path, tokenizer) -> list[str]:
    """Each token cache of a site (what its ranks memory-map and sample from), decoded."""
    out = []
    for index in sorted(site_dir.glob("text_cache/*/index.json")):
        meta = json.loads(index.read_text())
        for info in meta["splits"].values():
            ids = np.fromfile(index.parent / info["file"], dtype=np.dtype(meta["dtype"]))
            out.append(tokenizer.decode(ids.tolist()))
    return out


def test_seeded_pii_never_reaches_a_trainer_rank_nor_leaves_a_site(tmp_path, marker, monkeypatch):
    monkeypatch.setenv(launcher.MARKER, marker)
    model = tiny_gpt2(tmp_path / "gpt2")
    corpus = tmp_path / "corpus"
    truth = {site: write_seeded_site(corpus, site) for site in SEEDED_PII}
    raw = "".join(p.read_text() for p in corpus.rglob("*") if p.is_file())
    assert all(v in raw for site in SEEDED_PII.values() for vs in site.values() for v in vs)
    cfg = {
        "federation": {"name": "pii-e2e", "rounds": 1, "quorum": 2, "evaluate": False,
                       "deadlines": {"connect_s": 90, "round_s": 180, "trainer_start_s": 300}},
        "workload": {"task": "hf-causal-lm", "options": {"model_dir": str(model), "seq_len": 16,
                                                         "data": [str(corpus / "{site}" / "*")]}},
        "sites": [{"id": "paris", "ranks": 2, "partition": 0, "local_steps": 2, "batch_size": 4, "lr": 1e-3,
                   "optimizer": "adamw"},
                  {"id": "berlin", "ranks": 1, "partition": 1, "local_steps": 2, "batch_size": 4, "lr": 1e-3,
                   "optimizer": "adamw"}],
    }
    path = write_config(tmp_path / "pii.yaml", cfg)
    run = tmp_path / "run"
    lines: list[str] = []
    tap = WireTap()
    try:
        result = launcher.simulate(path, run, lines.append, insecure=True, tap=tap.start)
    finally:
        tap.close()
    assert result["status"] == "ok", "\n".join(lines)
    assert live_marked(marker) == []

    # every token sequence a rank can sample: scrubbed before tokenization
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    for site in SEEDED_PII:
        texts = _decoded_caches(run / "sites" / site, tokenizer)
        assert texts and any("<EMAIL_ADDRESS>" in t for t in texts), site
        joined = "\n".join(texts)
        squeezed = joined.replace(" ", "").replace("-", "")
        assert [v for v in SEEDED if v in joined or v in squeezed] == [], f"{site}: PII in the token cache"
        log = (run / "logs" / f"site-{site}-trainer.log").read_text()
        assert len(re.findall(r"token cache \S+ built in", log)) == 1, f"{site}: built once per site, by rank 0"
        n = truth[site]["EMAIL_ADDRESS"]
        assert re.search(rf"site {site}: PII scrubbed before tokenization: .*EMAIL_ADDRESS {n}\b", log), site

    # the counts, and only the counts, in the round's metrics line
    (line,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert line["status"] == "aggregated"
    for site, counts in truth.items():
        assert line["sites"][site]["pii"] == {e: counts.get(e, 0) for e in PATTERN_ENTITIES}
    assert b"pii_EMAIL_ADDRESS" in bytes(tap.up), "the capture does not see the sites' metrics"

    # nowhere else either: the wire, and every file the run wrote (logs, metrics, SuperLink state,
    # checkpoints, the sites' scrub caches and reports, token caches)
    needles = [v.encode() for v in SEEDED]
    assert [n for n in needles if n in bytes(tap.up) or n in bytes(tap.down)] == []
    leaks = [(str(f.relative_to(run)), n.decode()) for f in sorted(run.rglob("*")) if f.is_file()
             for n in needles if n in f.read_bytes()]
    assert leaks == []
    assert [v for v in SEEDED if any(v in x for x in lines)] == []
