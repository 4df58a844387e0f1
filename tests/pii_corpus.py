"""A labelled synthetic PII corpus: Faker values in ordinary prose, every true span known.

Shared by tests/test_pii_*.py and benchmarks/pii_scrub.py. Locales fr_FR, de_DE, en_GB, it_IT.
Faker has no German Steuer-ID or Personalausweis number and its en_GB "ssn" is not a valid NINO,
so the German IDs are generated here from their published check-digit rules (and cross-checked
against Presidio's validators in the tests); UK national insurance numbers are left out.
"""

from __future__ import annotations

import random
import sysconfig
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOCALES = ("fr_FR", "de_DE", "en_GB", "it_IT")
VALIDATED = ("EMAIL_ADDRESS", "IBAN_CODE", "CREDIT_CARD", "IP_ADDRESS")

TEMPLATES = {
    "fr_FR": [
        "Bonjour, je suis {PERSON} et vous pouvez m'écrire à {EMAIL_ADDRESS} pour le dossier.",
        "Merci de rappeler le {PHONE_NUMBER} avant vendredi.",
        "Le virement sera fait sur le compte {IBAN_CODE} dès réception de la facture.",
        "La carte {CREDIT_CARD} a été refusée lors du paiement en ligne.",
        "La connexion venait de l'adresse {IP_ADDRESS}, selon les journaux du serveur.",
        "Son numéro de sécurité sociale est le {FR_NIR}, à vérifier auprès de la caisse.",
    ],
    "de_DE": [
        "Sehr geehrte Frau {PERSON}, bitte antworten Sie an {EMAIL_ADDRESS} bis Montag.",
        "Rufen Sie uns unter {PHONE_NUMBER} an, wir sind werktags erreichbar.",
        "Bitte überweisen Sie den Betrag auf {IBAN_CODE} mit dem Verwendungszweck Miete.",
        "Die Kreditkarte {CREDIT_CARD} wurde gesperrt.",
        "Der Zugriff erfolgte von {IP_ADDRESS} aus, laut Protokoll.",
        "Ihre Steuer-ID lautet {DE_TAX_ID}; bitte geben Sie sie in der Erklärung an.",
        "Die Nummer des Personalausweises ist {DE_ID_CARD} und gilt bis 2031.",
    ],
    "en_GB": [
        "Dear {PERSON}, please reply to {EMAIL_ADDRESS} at your earliest convenience.",
        "You can reach the branch on {PHONE_NUMBER} during office hours.",
        "Payment should be made to {IBAN_CODE} quoting your reference.",
        "The card ending the transaction was {CREDIT_CARD}, which the bank declined.",
        "Our logs show a login from {IP_ADDRESS} last night.",
    ],
    "it_IT": [
        "Gentile {PERSON}, la preghiamo di scrivere a {EMAIL_ADDRESS} per confermare.",
        "Può chiamarci al numero {PHONE_NUMBER} dal lunedì al venerdì.",
        "Il bonifico va effettuato sul conto {IBAN_CODE} entro fine mese.",
        "La carta di credito {CREDIT_CARD} risulta scaduta.",
        "L'accesso è avvenuto dall'indirizzo {IP_ADDRESS} alle 3 di notte.",
        "Il codice fiscale del cliente è {IT_FISCAL_CODE}, come da documento.",
    ],
}


def de_tax_id(rng: random.Random) -> str:
    """A Steueridentifikationsnummer: first digit 1-9, one digit of the first ten twice, no digit
    more than three times, then the ISO 7064 MOD 11,10 check digit."""
    while True:
        body = [rng.randint(1, 9)] + [rng.randint(0, 9) for _ in range(9)]
        if max(Counter(body).values()) > 3 or len(set(body)) == 10:
            continue
        product = 10
        for d in body:
            s = (d + product) % 10 or 10
            product = (s * 2) % 11
        check = (11 - product) % 10
        return "".join(map(str, body)) + str(check)


_ICAO = "CFGHJKLMNPRTVWXYZ0123456789"


def de_id_card(rng: random.Random) -> str:
    """A Personalausweis (nPA) document number: 8 characters from the ICAO-restricted set (the
    first a letter), then the ICAO 9303 check digit (weights 7, 3, 1; A=10 ... Z=35)."""
    body = rng.choice(_ICAO[:17]) + "".join(rng.choice(_ICAO) for _ in range(7))
    total = sum((int(c) if c.isdigit() else ord(c) - 55) * (7, 3, 1)[i % 3] for i, c in enumerate(body))
    return body + str(total % 10)


def _grouped(s: str, size: int = 4, sep: str = " ") -> str:
    return sep.join(s[i:i + size] for i in range(0, len(s), size))


def _card_written(card: str, rng: random.Random) -> str:
    """Contiguous, or grouped as printed on cards: 4-4-4(-4(-3)), Amex/Diners 4-6-5/4-6-4, 4-3-3-3."""
    if rng.random() < 0.5:
        return card
    sep = " " if rng.random() < 0.75 else "-"
    n = len(card)
    if n in (14, 15):
        return sep.join((card[:4], card[4:10], card[10:]))
    if n == 13:
        return sep.join((card[:4], card[4:7], card[7:10], card[10:]))
    return _grouped(card, sep=sep)


def _nir_spaced(nir: str) -> str:
    return " ".join((nir[0], nir[1:3], nir[3:5], nir[5:7], nir[7:10], nir[10:13], nir[13:15]))


def value(fake, rng: random.Random, entity: str) -> str:
    """One value of `entity` in one of the forms people write it."""
    if entity == "PERSON":
        return f"{fake.first_name()} {fake.last_name()}"
    if entity == "EMAIL_ADDRESS":
        return rng.choice((fake.email, fake.free_email, fake.company_email))()
    if entity == "PHONE_NUMBER":
        return fake.phone_number()
    if entity == "IBAN_CODE":
        iban = fake.iban()
        return _grouped(iban) if rng.random() < 0.5 else iban
    if entity == "CREDIT_CARD":
        while True:
            card = fake.credit_card_number()
            # Faker's Maestro list has "0604": ISO/IEC 7812 major industry identifier 0 is not a
            # card issuer's (ISO/TC 68), no such card exists; it is not a labelled card here.
            if not card.startswith("0"):
                break
        return _card_written(card, rng)
    if entity == "IP_ADDRESS":
        return fake.ipv6() if rng.random() < 0.25 else fake.ipv4()
    if entity == "FR_NIR":
        nir = fake.ssn()
        return _nir_spaced(nir) if rng.random() < 0.5 else nir
    if entity == "DE_TAX_ID":
        tid = de_tax_id(rng)
        return f"{tid[:2]} {tid[2:5]} {tid[5:8]} {tid[8:]}" if rng.random() < 0.3 else tid
    if entity == "DE_ID_CARD":
        return de_id_card(rng)
    if entity == "IT_FISCAL_CODE":
        return fake.ssn()
    raise KeyError(entity)


@dataclass
class LabelledDoc:
    text: str
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, entity)
    locale: str = ""


def _fill(template: str, fake, rng: random.Random, out: list[str], spans: list, pos: int) -> int:
    """Append the template with its slots filled; record each slot's span. Returns the new length."""
    rest = template
    while "{" in rest:
        head, _, tail = rest.partition("{")
        entity, _, rest = tail.partition("}")
        out.append(head)
        pos += len(head)
        v = value(fake, rng, entity)
        out.append(v)
        spans.append((pos, pos + len(v), entity))
        pos += len(v)
    out.append(rest)
    return pos + len(rest)


def labelled_docs(n_docs: int, seed: int = 0, sentences: int = 12) -> list[LabelledDoc]:
    """n_docs documents, each in one locale: prose with a PII sentence every other sentence."""
    from faker import Faker

    rng = random.Random(seed)
    fakers = {loc: Faker(loc) for loc in LOCALES}
    for i, f in enumerate(fakers.values()):
        f.seed_instance(seed * 10 + i)
    docs = []
    for d in range(n_docs):
        loc = LOCALES[d % len(LOCALES)]
        fake = fakers[loc]
        out: list[str] = []
        spans: list = []
        pos = 0
        for s in range(sentences):
            if s % 2:
                pos = _fill(rng.choice(TEMPLATES[loc]), fake, rng, out, spans, pos)
            else:
                filler = fake.sentence(nb_words=rng.randint(8, 20))
                out.append(filler)
                pos += len(filler)
            sep = "\n\n" if rng.random() < 0.2 else " "
            out.append(sep)
            pos += len(sep)
        docs.append(LabelledDoc("".join(out), spans, loc))
    return docs


def stdlib_files(limit_bytes: int, *, include_tests: bool = False) -> list[Path]:
    """Python standard library sources and docs (pydoc_data first), sorted, up to limit_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / "pydoc_data" / "topics.py"]
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if p in files or "site-packages" in rel or (not include_tests and ("test" in rel or "tests" in rel)):
            continue
        files.append(p)
    out, total = [], 0
    for p in files:
        if total >= limit_bytes:
            break
        out.append(p)
        total += p.stat().st_size
    return out


def seeded_stdlib(limit_bytes: int, seed: int = 0, every: int = 4000) -> list[LabelledDoc]:
    """Stdlib files with one labelled PII sentence inserted about every `every` characters (at
    line breaks). The stdlib's own PII (authors' e-mail addresses) is not labelled: evaluate
    against these docs with `evaluate(..., ignore=stdlib_own)`."""
    from faker import Faker

    rng = random.Random(seed)
    fakers = {loc: Faker(loc) for loc in LOCALES}
    for i, f in enumerate(fakers.values()):
        f.seed_instance(seed * 10 + i + 1)
    docs = []
    for p in stdlib_files(limit_bytes):
        src = p.read_text(encoding="utf-8", errors="replace")
        out: list[str] = []
        spans: list = []
        pos = last = 0
        while True:
            nxt = src.find("\n", last + every)
            if nxt < 0:
                break
            out.append(src[last:nxt + 1])
            pos += nxt + 1 - last
            loc = rng.choice(LOCALES)
            pos = _fill("# " + rng.choice(TEMPLATES[loc]) + "\n", fakers[loc], rng, out, spans, pos)
            last = nxt + 1
        out.append(src[last:])
        docs.append(LabelledDoc("".join(out), spans, "stdlib"))
    return docs


@dataclass
class Score:
    tp: int = 0  # true spans fully covered by a prediction of their type
    fn: int = 0  # true spans not fully covered
    ok: int = 0  # predictions overlapping a true span of their type
    fp: int = 0  # predictions overlapping none

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else float("nan")

    @property
    def precision(self) -> float:
        found = self.ok + self.fp
        return self.ok / found if found else float("nan")


def evaluate(docs: Sequence[LabelledDoc], predicted: Iterable[Sequence[tuple[int, int, str]]],
             entities: Sequence[str]) -> dict[str, Score]:
    """Per entity: a true span is recalled when a prediction of its type covers all of it (a
    partly masked value still leaks); a prediction is a false positive when it overlaps no true
    span of its type. Predictions of types outside `entities` are ignored."""
    scores: dict[str, Score] = defaultdict(Score)
    for doc, pred in zip(docs, predicted):
        pred = [p for p in pred if p[2] in entities]
        for s, e, ent in doc.spans:
            if ent not in entities:
                continue
            if any(ps <= s and e <= pe and pent == ent for ps, pe, pent in pred):
                scores[ent].tp += 1
            else:
                scores[ent].fn += 1
        for ps, pe, pent in pred:
            if any(ps < e and s < pe and ent == pent for s, e, ent in doc.spans):
                scores[pent].ok += 1
            else:
                scores[pent].fp += 1
    return dict(scores)


def table(scores: dict[str, Score], title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"{'entity':16s} {'true':>6s} {'found':>6s} {'recall':>7s} {'precision':>9s}")
    for ent in sorted(scores):
        s = scores[ent]
        lines.append(f"{ent:16s} {s.tp + s.fn:6d} {s.ok + s.fp:6d} {s.recall:7.4f} {s.precision:9.4f}")
    return "\n".join(lines)


# ---- a site's raw files with known PII strings (the text data path's tests and its e2e run) -----
SEEDED_PII: dict[str, dict[str, tuple[str, ...]]] = {
    "paris": {"EMAIL_ADDRESS": ("jeanne.martin@banque-exemple.fr", "p.dubois@credit-lyonnais-test.fr"),
              "IBAN_CODE": ("FR76 3000 6000 0112 3456 7890 189",),
              "CREDIT_CARD": ("4111 1111 1111 1111",),
              "PHONE_NUMBER": ("+33 1 42 68 53 00",)},
    "berlin": {"EMAIL_ADDRESS": ("k.schmidt@beispiel-bank.de",),
               "IBAN_CODE": ("DE89 3704 0044 0532 0130 00",),
               "CREDIT_CARD": ("5555-5555-5555-4444",),
               "PHONE_NUMBER": ("030 901820",)},
}
_FILLER = ("The quarterly review of the lending desk went well and the committee agreed on the new terms. "
           "Customers asked about fees, opening hours and the mobile application. "
           "Le conseil a validé le rapport annuel et la direction remercie les équipes. "
           "Die Filiale bleibt im August geschlossen, die Beratung findet online statt. ")


def leak_forms(value: str) -> set[str]:
    """How a seeded value could appear in decoded text: as written, and without spaces or hyphens."""
    return {value, value.replace(" ", "").replace("-", "")}


def write_seeded_site(root: Path, site: str, filler_repeats: int = 6) -> dict[str, int]:
    """`root/site/letters.txt` and `root/site/notes.jsonl`: prose (no digits, nothing personal) with
    each of the site's `SEEDED_PII` values once in the .txt file and once, digits run together, in a
    .jsonl document. Returns the true count per entity type."""
    import json

    d = root / site
    d.mkdir(parents=True, exist_ok=True)
    values = [(ent, v) for ent, vs in SEEDED_PII[site].items() for v in vs]
    letters = [_FILLER * filler_repeats]
    for ent, v in values:
        letters.append(f"Pour le dossier {ent.lower()}, voir {v} ci-dessous.\n\n{_FILLER * filler_repeats}")
    (d / "letters.txt").write_text("\n\n".join(letters), encoding="utf-8")
    with (d / "notes.jsonl").open("w", encoding="utf-8") as f:
        for i, (ent, v) in enumerate(values):
            compact = v if ent in ("EMAIL_ADDRESS", "PHONE_NUMBER") else v.replace(" ", "").replace("-", "")
            f.write(json.dumps({"text": f"{_FILLER * 3}Note {chr(65 + i)}: contact {compact} today. {_FILLER}"},
                               ensure_ascii=False) + "\n")
    counts: dict[str, int] = {}
    for ent, _ in values:
        counts[ent] = counts.get(ent, 0) + 2
    return counts
