"""Synthetic compliance Q&A conversations, made here (no download): what a bank's compliance
team's assistant would be tuned on. Deterministic for a seed; each site gets its own mix of topics
(non-IID), mostly in the conversational form, some as prompt-completion pairs.

    python examples/compliance_sft/compliance_data.py OUT_DIR --sites paris,berlin --rows 300
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "You are the compliance desk of a European bank."
CURRENCIES = ["EUR", "USD", "GBP", "CHF"]
COUNTRIES = ["France", "Germany", "Italy", "Spain", "the Netherlands", "Poland", "Ireland"]
PRODUCTS = ["current account", "mortgage", "trade finance line", "custody account", "payment card"]


def _cash(r: random.Random) -> tuple[str, str]:
    amount, cur = r.choice([5_000, 9_500, 10_000, 12_000, 15_000, 50_000]), r.choice(CURRENCIES)
    if amount >= 10_000:
        return (f"A customer deposits {amount:,} {cur} in cash. Do we report it?",
                f"Yes. Cash of 10,000 {cur} or more is reported to the financial intelligence unit within "
                "15 days, with the customer's identity verified first.")
    return (f"A customer deposits {amount:,} {cur} in cash. Do we report it?",
            f"Not for the amount alone: {amount:,} {cur} is below the 10,000 {cur} threshold. Report it if it "
            "looks like one of several deposits split to stay under it (structuring).")


def _kyc(r: random.Random) -> tuple[str, str]:
    product, country = r.choice(PRODUCTS), r.choice(COUNTRIES)
    return (f"What do we need before opening a {product} for a company registered in {country}?",
            f"Customer due diligence: the company's registration, its beneficial owners above 25 percent, "
            f"their identity documents, and the purpose of the {product}. Keep the file for five years.")


def _retention(r: random.Random) -> tuple[str, str]:
    years = r.choice([5, 10])
    record = "transaction records" if years == 5 else "accounting documents"
    return (f"How long do we keep {record}?",
            f"{years} years after the end of the business relationship for {record}, then delete them "
            "unless a legal hold applies.")


def _sanctions(r: random.Random) -> tuple[str, str]:
    country = r.choice(["a sanctioned jurisdiction", "a high-risk third country"])
    return (f"A payment is routed through {country}. What now?",
            "Stop the payment, screen every party against the sanctions lists, and escalate to the "
            "sanctions officer before releasing it. Document the decision.")


def _gdpr(r: random.Random) -> tuple[str, str]:
    days = 30
    return ("A customer asks for all the personal data we hold on them. What is the deadline?",
            f"Answer the access request within {days} days, free of charge; extend by two months only for "
            "complex requests, and tell the customer why.")


TOPICS = [_cash, _kyc, _retention, _sanctions, _gdpr]


def conversation(r: random.Random, weights: list[float]) -> dict:
    """One row: a one- or two-turn conversation, or a prompt-completion pair."""
    topic = r.choices(TOPICS, weights)[0]
    question, answer = topic(r)
    if r.random() < 0.2:
        return {"prompt": question, "completion": answer}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
                {"role": "assistant", "content": answer}]
    if r.random() < 0.3:
        q2, a2 = r.choices(TOPICS, weights)[0](r)
        messages += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
    return {"messages": messages}


def write_site(out: Path, site_index: int, rows: int, seed: int = 0) -> Path:
    """`out/train.jsonl` and `out/val.jsonl` (a tenth of the rows) for one site."""
    r = random.Random(seed * 1000 + site_index)
    weights = [1.0 + 3.0 * ((i + site_index) % len(TOPICS) == 0) for i in range(len(TOPICS))]  # a favourite topic
    out.mkdir(parents=True, exist_ok=True)
    n_val = max(1, rows // 10)
    for name, n in (("train", rows - n_val), ("val", n_val)):
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for _ in range(n):
                f.write(json.dumps(conversation(r, weights)) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--sites", default="paris,berlin")
    p.add_argument("--rows", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for i, site in enumerate(a.sites.split(",")):
        print(write_site(a.out / site, i, a.rows, a.seed))


if __name__ == "__main__":
    main()
