"""Every core: the process pool gives the same documents, in the same order, and the same report
(counts and the deterministic redaction sample) as one process."""

from __future__ import annotations

from pii_corpus import labelled_docs
from site_trainer.pii import CorpusScrubber, PiiConfig


def test_pool_equals_one_process_in_input_order(tmp_path):
    docs = [(f"doc{i}", d.text) for i, d in enumerate(labelled_docs(240, seed=11))]
    cfg = PiiConfig(action="replace")
    with CorpusScrubber(cfg, cache_dir=tmp_path / "c1", workers=1) as one:
        expected = list(one.map(docs))
        rep1 = one.finish()
    (tmp_path / "c2").mkdir()
    (tmp_path / "c2" / "surrogate.key").write_bytes((tmp_path / "c1" / "surrogate.key").read_bytes())
    seen = []
    with CorpusScrubber(cfg, cache_dir=tmp_path / "c2", workers=2, inline_bytes=0) as pool:
        got = list(pool.map(docs, progress=lambda n, b: seen.append(n)))
        rep2 = pool.finish()
        assert pool._pool is not None  # the work went through worker processes
    assert [p for p, _ in got] == [p for p, _ in docs]
    assert got == expected
    assert rep2.counts == rep1.counts and rep2.documents == len(docs) and seen[-1] == len(docs)
    assert rep2.to_json()["samples"] == rep1.to_json()["samples"]
    assert rep2.cpu_seconds > 0 and rep2.fingerprint == rep1.fingerprint
