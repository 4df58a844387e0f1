"""False positives on PII-free text: the Python standard library's sources and docs.

The stdlib is not quite PII-free: its authors left their e-mail addresses in it (`Author: Steven J.
Bethard <steven.bethard@...>`). Those are personal data and masking them is right; a detection
counts as a false positive only when it is not an address at all (checked by a plain address
syntax independent of the recognizer). Everything else the validated recognizers report in the
stdlib is a false positive."""

from __future__ import annotations

import re
from collections import Counter

from pii_corpus import VALIDATED, stdlib_files
from site_trainer.pii import PiiConfig
from site_trainer.pii.scrubber import Scrubber

ADDRESS = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
BUDGET_BYTES = 6_000_000


def test_at_most_one_false_positive_per_mb_on_stdlib():
    scrubber = Scrubber(PiiConfig())
    fp, addresses, nbytes, examples = Counter(), 0, 0, []
    for path in stdlib_files(BUDGET_BYTES):  # pydoc_data/topics.py (the docs) first, then sources
        text = path.read_text(encoding="utf-8", errors="replace")
        nbytes += len(text.encode())
        for s in scrubber.analyze(text):
            value = text[s.start:s.end]
            if s.entity == "EMAIL_ADDRESS" and ADDRESS.fullmatch(value):
                addresses += 1
                continue
            fp[s.entity] += 1
            examples.append(f"{path.name}: {s.entity} {value!r}")
    mb = nbytes / 1e6
    validated = sum(fp[e] for e in VALIDATED)
    print(f"\nstdlib docs and sources, {mb:.1f} MB: {addresses} authors' e-mail addresses (real PII) found")
    for ent, n in sorted(fp.items()):
        print(f"  {ent:16s} {n:4d} false positives  {n / mb:.2f}/MB")
    print(f"  validated entities: {validated / mb:.2f} false positives per MB")
    print("  " + "\n  ".join(examples[:15]))
    assert mb >= 5
    assert validated / mb <= 1.0, examples
