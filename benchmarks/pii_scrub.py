"""PII scrubbing throughput and recall: our scrubber against Presidio's AnalyzerEngine, one core each.

Corpus: Python standard-library sources and docs (pydoc_data first) with a labelled Faker PII
sentence (fr_FR, de_DE, en_GB, it_IT: names, e-mails, phones, IBANs, cards, IPs, national IDs)
inserted about every 4000 characters; the same documents for both, in one run.

Anchor, as Presidio's docs show it: `AnalyzerEngine()` with its default recognizer registry and
`analyzer.analyze(text=doc, entities=ENTITIES, language="en")`, ENTITIES being the types both
detect (EMAIL_ADDRESS, IBAN_CODE, CREDIT_CARD, IP_ADDRESS, PHONE_NUMBER). Two changes keep it
offline, neither making it slower: its NLP engine is a *blank* spaCy English pipeline saved to a
temporary directory (the default engine would download en_core_web_lg; blank means tokenization
only, no NER), and TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS is empty so tldextract uses its bundled
public-suffix list instead of fetching it. A warm-up call each (every entity type
once) before timing.

Ours: `CorpusScrubber(PiiConfig(entities=ENTITIES), workers=1)` called per document, the text data
path's transform (pre-filter, Presidio recognizers on windows, Presidio's anonymizer: it also masks,
the anchor only analyzes). Figures are CPU seconds of this process (one core); ours is the
median of --repeats runs. `--pool` adds a run over all cores (`map` through the worker pool, no
cache), wall time once the pool is up, its start-up time printed apart.

Recall: a labelled value counts when a finding of its type covers all of it. recall_validated
pools EMAIL_ADDRESS, IBAN_CODE, CREDIT_CARD and IP_ADDRESS. The last line is
    RESULT speedup=<ours/presidio MB/s> mb_s_per_core=<ours> recall_validated=<ours>

    python benchmarks/pii_scrub.py              # 4 MB
    python benchmarks/pii_scrub.py --mb 1       # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ["TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS"] = ""  # the anchor's tldextract: bundled list, no fetch

from pii_corpus import VALIDATED, Score, evaluate, labelled_docs, seeded_stdlib, table  # noqa: E402

ENTITIES = ["EMAIL_ADDRESS", "IBAN_CODE", "CREDIT_CARD", "IP_ADDRESS", "PHONE_NUMBER"]


def presidio_anchor(tmp: Path):
    import spacy
    from presidio_analyzer import AnalyzerEngine
    from presidio_analyzer.nlp_engine import SpacyNlpEngine

    spacy.blank("en").to_disk(tmp / "blank_en")
    engine = SpacyNlpEngine(models=[{"lang_code": "en", "model_name": str(tmp / "blank_en")}])
    analyzer = AnalyzerEngine(nlp_engine=engine)
    return lambda text: [(r.start, r.end, r.entity_type)
                         for r in analyzer.analyze(text=text, entities=ENTITIES, language="en")]


def timed(fn, texts) -> tuple[float, list]:
    t0 = time.process_time()
    out = [fn(t) for t in texts]
    return time.process_time() - t0, out


def pooled(scores: dict[str, Score], entities) -> float:
    tp = sum(scores[e].tp for e in entities if e in scores)
    fn = sum(scores[e].fn for e in entities if e in scores)
    return tp / (tp + fn) if tp + fn else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=4.0, help="corpus size in MB (10^6 bytes)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of ours (median); the anchor runs once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", action="store_true", help="also time all cores through the process pool")
    args = ap.parse_args()

    from site_trainer.pii import CorpusScrubber, PiiConfig

    docs = seeded_stdlib(int(args.mb * 1e6), seed=args.seed)
    texts = [d.text for d in docs]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"corpus: {len(docs)} stdlib files, {mb:.2f} MB, {sum(len(d.spans) for d in docs)} labelled PII values")

    with tempfile.TemporaryDirectory() as tmp:
        presidio = presidio_anchor(Path(tmp))
        ours_scrubber = CorpusScrubber(PiiConfig(entities=ENTITIES), workers=1)
        engine = ours_scrubber._engine.scrubber

        def ours(text):
            ours_scrubber("doc", text)  # the transform users run: analyze + anonymize

        # warm-up: every entity type once (lazy compiles, phone-plan metadata, the anonymizer)
        warm = " ".join(d.text for d in labelled_docs(8, seed=args.seed + 1))
        presidio(warm)
        ours(warm)
        ours_runs = [timed(ours, texts)[0] for _ in range(args.repeats)]
        t_ours = statistics.median(ours_runs)
        t_presidio, pred_presidio = timed(presidio, texts)
        pred_ours = [[(s.start, s.end, s.entity) for s in engine.analyze(t)] for t in texts]

        full = CorpusScrubber(PiiConfig(), workers=1)  # every default entity, national IDs included
        full("doc", warm)
        t_full = timed(lambda t: full("doc", t), texts)[0]

    s_ours, s_pres = evaluate(docs, pred_ours, ENTITIES), evaluate(docs, pred_presidio, ENTITIES)
    print(table(s_pres, "\nPresidio AnalyzerEngine (default recognizers, blank spaCy):"))
    print(table(s_ours, "\nours (same entities):"))
    print("\n(the stdlib's own e-mail addresses are real but unlabelled: they lower both precisions alike)")
    r_ours, r_pres = pooled(s_ours, VALIDATED), pooled(s_pres, VALIDATED)
    v_ours, v_pres = mb / t_ours, mb / t_presidio
    print(f"\nPresidio: {t_presidio:7.2f} s CPU  {v_pres:7.3f} MB/s per core  recall_validated {r_pres:.4f}")
    print(f"ours    : {t_ours:7.2f} s CPU  {v_ours:7.3f} MB/s per core  recall_validated {r_ours:.4f}  "
          f"(runs {', '.join(f'{x:.2f}' for x in ours_runs)} s)")
    print(f"ours, all default entities (+FR_NIR, DE_TAX_ID, DE_ID_CARD, IT_FISCAL_CODE): {mb / t_full:.3f} MB/s per core")
    if args.pool:
        from site_trainer.pii.corpus import default_workers

        n = default_workers()
        with CorpusScrubber(PiiConfig(entities=ENTITIES), workers=n, inline_bytes=0) as pool:
            t0 = time.perf_counter()
            pool._start_pool()
            pool._started.wait()
            t1 = time.perf_counter()
            for _ in pool.map((f"d{i}", t) for i, t in enumerate(texts)):
                pass
            wall = time.perf_counter() - t1
        print(f"all cores: {n} worker processes, {mb / wall:.3f} MB/s wall once started "
              f"(start-up {t1 - t0:.1f} s: the forkserver imports Presidio once)")
    print(f"RESULT speedup={v_ours / v_pres:.2f} mb_s_per_core={v_ours:.2f} recall_validated={r_ours:.4f}")


if __name__ == "__main__":
    main()
