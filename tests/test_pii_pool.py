"""Every core: the process pool gives the same documents, in the same order, and the same report
(counts and the deterministic redaction sample) as one process, whether it does all the work or
takes over from the calling process once its workers are up."""

from __future__ import annotations

from pii_corpus import labelled_docs
from site_trainer.pii import CorpusScrubber, PiiConfig


def test_pool_equals_one_process_in_input_order(tmp_path):
    docs = [(f"doc{i}", d.text) for i, d in enumerate(labelled_docs(240, seed=11))]
    cfg = PiiConfig(action="replace")
    with CorpusScrubber(cfg, cache_dir=tmp_path / "c1", workers=1) as one:
        expected = list(one.map(docs))
        rep1 = one.finish()
    key = (tmp_path / "c1" / "surrogate.key").read_bytes()

    def pooled(name: str, inline_bytes: int, inline_docs: int | None = None):
        (tmp_path / name).mkdir()
        (tmp_path / name / "surrogate.key").write_bytes(key)
        seen, sent = [], []
        with CorpusScrubber(cfg, cache_dir=tmp_path / name, workers=2, inline_bytes=inline_bytes) as pool:
            submit = pool._submit
            pool._submit = lambda batch, *a: sent.extend(p for p, _ in batch) or submit(batch, *a)
            if inline_docs is not None:  # the pool "becomes ready" after exactly inline_docs documents
                calls = iter(range(10 ** 6))
                pool._pool_ready = lambda: next(calls) >= inline_docs and pool._started.wait(600)
            got = list(pool.map(docs, progress=lambda n, b: seen.append(n)))
            rep = pool.finish()
        assert seen == list(range(1, len(docs) + 1))
        return got, rep, sent

    names = [p for p, _ in docs]
    for (got, rep, sent), to_workers in ((pooled("all", 0), names), (pooled("handoff", 1, inline_docs=60), names[60:])):
        assert sent == to_workers  # what went through worker processes
        assert [p for p, _ in got] == names and got == expected
        assert rep.counts == rep1.counts and rep.documents == len(docs) and rep.fingerprint == rep1.fingerprint
        assert rep.to_json()["samples"] == rep1.to_json()["samples"]
