"""Detectors: Presidio's pattern recognizers and checksum validators, adapted to corpora.

A `Detector` is the plug-in unit. It names one entity type, a cheap `trigger` (a stdlib `re`
pattern) and `find(text)`. The contract that makes the pre-filter exact: every span `find` can
return overlaps a match of `trigger` and lies within `margin` characters of it (see
`scrubber.windows`). A detector with `trigger=None` (a NER model) sees whole documents.

The built-ins wrap Presidio recognizers; where Presidio's stock behaviour is wrong for a sovereign
corpus they are subclassed, never copied:
- e-mail: the domain is checked against tldextract's *bundled* public-suffix snapshot (Presidio's
  recognizer calls `tldextract.extract`, which fetches the list from the network at run time);
- credit cards: Presidio's Luhn check, plus 12-19 digit numbers (Presidio's pattern stops at 17
  and misses 19-digit Visa and 12-digit Maestro) and the issuer-prefix/length table;
- IP: loopback and unspecified addresses name no machine; Python slices like `a[1::2]` parse as
  IPv6 and are refused;
- phone numbers: the site's numbering plans (EU by default, Presidio's default is US-centred);
- FR NIR: Presidio has no French recognizer; DE Steuer-ID also in its printed 2-3-3-3 grouping.
Every numeric detector refuses spans glued to a longer number (decimals, version strings).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import re
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points, version
from typing import TYPE_CHECKING

from .detector import Detector, Span

if TYPE_CHECKING:
    from .config import PiiConfig

PLUGIN_GROUP = "sovereign_fl.pii_recognizers"
log = logging.getLogger("sovfl.pii")


# --------------------------------------------------------------------------------------------
# Presidio-backed detectors

def _glued(text: str, start: int, end: int, glue: str = ".,") -> bool:
    """True when [start, end) is the middle of a longer token or number: `3.14159265358979`,
    `v1.2.3.4.5`, `x41111111...`: the digits are part of something else. `glue`: the separators
    that join digits into one number (`.` and the decimal comma)."""
    if start > 0:
        c = text[start - 1]
        if c.isalnum() or c == "_" or (c in glue and start > 1 and text[start - 2].isdigit()):
            return True
    if end < len(text):
        c = text[end]
        if c.isalnum() or c == "_" or (c in glue and end + 1 < len(text) and text[end + 1].isdigit()):
            return True
    return False


class PresidioDetector(Detector):
    """A Presidio `EntityRecognizer` run on windows; `reject` adds corpus-specific guards.

    `make` builds the recognizer on first use: a detector (and its fingerprint) exists without
    importing Presidio, which loads spaCy, transformers and torch (seconds). `params` names the
    settings that change results (phone regions) for the fingerprint."""

    def __init__(self, make: Callable, entity: str, trigger: str | tuple[str, ...], *, rank: int = 0,
                 glue: str | None = ".,", margin: int = 64, params: str = ""):
        self._make, self._recognizer = make, None
        self.entity = entity
        self.trigger = trigger
        self.rank = rank
        self.margin = margin
        self.glue = glue  # None: no glued-number guard
        name = getattr(make, "__name__", None) or getattr(getattr(make, "func", None), "__name__", "recognizer")
        self.version = f"{name}/presidio-{version('presidio-analyzer')}/{params}/glue={glue}/margin={margin}"

    @property
    def recognizer(self):
        if self._recognizer is None:
            self._recognizer = self._make()
        return self._recognizer

    def load(self) -> None:
        self.recognizer

    def reject(self, text: str, start: int, end: int) -> bool:
        return self.glue is not None and _glued(text, start, end, self.glue)

    def find(self, text: str) -> list[Span]:
        out = []
        for r in self.recognizer.analyze(text, [self.entity], None):
            if r.score > 0 and not self.reject(text, r.start, r.end):
                out.append(Span(r.start, r.end, self.entity, float(r.score)))
        return out


@functools.lru_cache(maxsize=1)
def offline_tld_extractor():
    """tldextract on its bundled public-suffix snapshot: no fetch, no cache directory written."""
    import tldextract

    extract = tldextract.TLDExtract(cache_dir=None, suffix_list_urls=(), fallback_to_snapshot=True)
    extract("warm.example.com")  # loads the snapshot now, not inside the first document's timing
    return extract


def _email_recognizer():
    from presidio_analyzer.predefined_recognizers import EmailRecognizer

    class OfflineEmailRecognizer(EmailRecognizer):
        """Presidio's e-mail pattern; the domain must end in a public suffix (bundled list)."""

        def load(self) -> None:
            offline_tld_extractor()

        def validate_result(self, pattern_text: str):
            return offline_tld_extractor()(pattern_text).fqdn != ""

    return OfflineEmailRecognizer()


# Issuer identification (ISO/IEC 7812): first digits -> allowed lengths. MII 0 (ISO/TC 68) and
# 1 (airlines, UATP) issue no payment cards in these sites' markets, except JCB's 1800/2131.
_CARD_IIN: tuple[tuple[tuple[str, ...], range], ...] = (
    (("4",), range(13, 20)),                                                     # Visa 13/16/19
    (tuple(str(x) for x in range(51, 56)), range(16, 17)),                       # Mastercard
    (tuple(str(x) for x in range(2221, 2721)), range(16, 17)),                   # Mastercard 2-series
    (("34", "37"), range(15, 16)),                                               # Amex
    (("300", "301", "302", "303", "304", "305", "3095", "36", "38", "39"), range(14, 20)),  # Diners
    (("35",), range(16, 20)),                                                    # JCB
    (("1800", "2131"), range(15, 16)),                                           # JCB 15
    (("50", "56", "57", "58", "6"), range(12, 20)),                              # Maestro, Discover, UnionPay
)


def card_issuer_ok(digits: str) -> bool:
    """Does a digit string have a card issuer's prefix and a length that issuer uses?"""
    return any(len(digits) in lengths and digits.startswith(prefixes) for prefixes, lengths in _CARD_IIN)


def _card_recognizer():
    from presidio_analyzer import Pattern
    from presidio_analyzer.predefined_recognizers import CreditCardRecognizer

    class CardRecognizer(CreditCardRecognizer):
        """Presidio's pattern and Luhn check, plus 12-19 digit groupings and the issuer table."""

        PATTERNS = [
            *CreditCardRecognizer.PATTERNS,
            Pattern("contiguous 12-19", r"\b\d{12,19}\b", 0.3),
            Pattern("groups of 4", r"\b\d{4}([ -])\d{4}\1\d{4}(?:\1\d{4}(?:\1\d{3})?)?\b", 0.3),
            Pattern("4-6-4/5", r"\b\d{4}([ -])\d{6}\1\d{4,5}\b", 0.3),
        ]

        def __init__(self):
            super().__init__(patterns=list(self.PATTERNS))

        def validate_result(self, pattern_text: str) -> bool:
            digits = pattern_text.replace(" ", "").replace("-", "")
            return card_issuer_ok(digits) and super().validate_result(pattern_text)

    return CardRecognizer()


# Never assigned to anyone: documentation (RFC 5737, RFC 3849) and "this network" (RFC 791).
_NOBODYS = ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "0.0.0.0/8", "2001:db8::/32")


@functools.lru_cache(maxsize=1)
def _nobodys_networks():
    import ipaddress

    return tuple(ipaddress.ip_network(n) for n in _NOBODYS)


def ip_is_personal(candidate: str) -> bool:
    """An address that can name a person's machine. Not: loopback, unspecified, multicast, IPv4
    reserved (240/4: the broadcast address, netmasks such as 255.255.255.0), documentation ranges,
    networks in CIDR notation. (IPv6 outside 2000::/3 is "reserved" too, but an IPv6-shaped string
    in text is an address more often than not: it stays masked.)
    Two shapes are read as what they nearly always are in text: an IPv4 whose first three parts are
    single digits is a version or section number (`7.1.4.34`, `8.2.4.44` in the stdlib), and an
    IPv6 written with short decimal groups around `::` is a Python slice (`a[1::2]`)."""
    import ipaddress

    addr = candidate.split("/")[0]
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
        iface = ipaddress.ip_interface(candidate.split("%")[0] if "/" not in candidate else candidate)
    except ValueError:
        return False
    if "/" in candidate and iface.network.prefixlen < iface.max_prefixlen and ip == iface.network.network_address:
        return False  # a network written in CIDR (10.0.0.0/8, fe80::/10), not a host
    if ip.is_loopback or ip.is_unspecified or ip.is_multicast or (ip.version == 4 and ip.is_reserved):
        return False
    if any(ip.version == n.version and ip in n for n in _nobodys_networks()):
        return False
    if ip.version == 4 and all(len(p) == 1 for p in addr.split(".")[:3]):
        return False
    if ip.version == 6 and "::" in addr and "." not in addr:
        groups = [g for g in addr.split(":") if g]
        if all(g.isdigit() and len(g) < 4 for g in groups):
            return False
    return True


def _ip_recognizer():
    from presidio_analyzer.predefined_recognizers import IpRecognizer

    class PersonalIpRecognizer(IpRecognizer):
        def invalidate_result(self, pattern_text: str) -> bool:
            return not ip_is_personal(pattern_text)

    return PersonalIpRecognizer()


def _phone_recognizer(regions: tuple[str, ...]):
    import phonenumbers
    from presidio_analyzer import EntityRecognizer
    from presidio_analyzer.predefined_recognizers import PhoneRecognizer

    runs = re.compile(_DIGIT_RUN)

    class SitePhoneRecognizer(PhoneRecognizer):
        """Presidio's phone recognizer (phonenumbers' matcher per region, leniency VALID) that stops
        trying regions once every digit run of the text is a found number: an international number
        is found by the first region already, and Presidio would find it again in each of the others."""

        def analyze(self, text, entities, nlp_artifacts=None):
            todo = [m.span() for m in runs.finditer(text)]
            results = []
            for region in self.supported_regions:
                for match in phonenumbers.PhoneNumberMatcher(text, region, leniency=self.leniency):
                    results.append(self._get_recognizer_result(match, text, region, nlp_artifacts))
                todo = [(s, e) for s, e in todo if not any(r.start <= s and e <= r.end for r in results)]
                if not todo:
                    break
            return EntityRecognizer.remove_duplicates(results)

    return SitePhoneRecognizer(supported_regions=regions, leniency=1)


_WIDE_GAP = re.compile(r"\d\s{4,}\d|\n|\.\.|--")


class PhoneDetector(PresidioDetector):
    """`phonenumbers` (through Presidio) on the site's numbering plans. Refused: a lone `.` between
    digits (a decimal: Presidio reports `0.333333333`), numbers of fewer than 7 digits, numbers
    spread over a line break or wide blanks (table columns): the trigger's contract, and nobody
    writes a phone number so; ranges (`0..999999`, `(0-999999`) and unbalanced parentheses. A `+CC ` written before a national
    number in the `+33 (0)1 ...` style is masked with it."""

    defer = True

    def reject(self, text: str, start: int, end: int) -> bool:
        s = text[start:end]
        if s.count(".") == 1 and not any(c in s for c in " -/()"):
            return True
        if sum(c.isdigit() for c in s) < 7 or _WIDE_GAP.search(s) or s.count("(") != s.count(")"):
            return True
        return super().reject(text, start, end)

    def find(self, text: str) -> list[Span]:
        out = []
        for sp in super().find(text):
            head = text[max(0, sp.start - 6):sp.start]
            m = _country_prefix().search(head) if text[sp.start] == "(" else None
            out.append(Span(sp.start - len(m.group(0)), sp.end, sp.entity, sp.score) if m else sp)
        return out


@functools.lru_cache(maxsize=1)
def _country_prefix():
    return re.compile(r"(?<![\w+])\+\d{1,3} ?$")


def nir_key_ok(nir: str) -> bool:
    """French NIR: 13 characters (digits, or 2A/2B for Corsica) and a 2-digit key, 97 - n mod 97."""
    s = nir.replace(" ", "").upper()
    if len(s) != 15 or not s[13:].isdigit():
        return False
    body = s[:13]
    body = body[:5] + body[5:7].replace("2A", "19").replace("2B", "18") + body[7:]
    if not body.isdigit() or body[0] not in "12":
        return False
    month = int(body[3:5])
    if not (1 <= month <= 12 or 20 <= month <= 42 or 50 <= month <= 99):
        return False
    return 97 - int(body) % 97 == int(s[13:])


def _nir_recognizer():
    from presidio_analyzer import Pattern, PatternRecognizer

    class FrNirRecognizer(PatternRecognizer):
        """Numéro d'inscription au répertoire (sécurité sociale), with or without its usual spaces."""

        PATTERNS = [Pattern("NIR", r"\b[12] ?\d{2} ?\d{2} ?(?:\d{2}|2[AB]) ?\d{3} ?\d{3} ?\d{2}\b", 0.3)]
        CONTEXT = ["sécurité sociale", "securite sociale", "nir", "insee", "numéro de sécu"]

        def __init__(self):
            super().__init__(supported_entity="FR_NIR", patterns=list(self.PATTERNS), context=self.CONTEXT,
                             supported_language="fr", global_regex_flags=0)

        def validate_result(self, pattern_text: str) -> bool:
            return nir_key_ok(pattern_text)

    return FrNirRecognizer()


def _de_tax_id_recognizer():
    from presidio_analyzer import Pattern
    from presidio_analyzer.predefined_recognizers import DeTaxIdRecognizer

    class GroupedDeTaxIdRecognizer(DeTaxIdRecognizer):
        """Presidio's Steuer-ID check, also on the 2-3-3-3 grouping printed on tax letters."""

        PATTERNS = [*DeTaxIdRecognizer.PATTERNS, Pattern("Steuer-ID grouped", r"\b[1-9]\d \d{3} \d{3} \d{3}\b", 0.3)]

        def __init__(self):
            super().__init__(patterns=list(self.PATTERNS))

        def validate_result(self, pattern_text: str):
            return super().validate_result(pattern_text.replace(" ", ""))

    return GroupedDeTaxIdRecognizer()


def _de_id_card_recognizer():
    from presidio_analyzer.predefined_recognizers import DeIdCardRecognizer

    class UpperDeIdCardRecognizer(DeIdCardRecognizer):
        """Presidio's nPA check digit; document numbers are printed upper case, so the pattern is
        case-sensitive (Presidio's ignores case and matches ordinary words ending in a digit)."""

        def __init__(self):
            super().__init__()
            self.global_regex_flags = 0

    return UpperDeIdCardRecognizer()


def _it_fiscal_code_recognizer():
    from presidio_analyzer.predefined_recognizers import ItFiscalCodeRecognizer

    return ItFiscalCodeRecognizer()


# Triggers: each is a superset of what its recognizer's patterns can match, written so that the
# regex engine can skip ahead fast (a literal or a small class first). A tuple: several scans.
_DIGIT_RUN = r"\d(?:[ \t\-./()\u00a0]{0,3}\d){6,}"  # >= 7 digits, light separators
TRIGGERS: dict[str, str | tuple[str, ...]] = {
    "EMAIL_ADDRESS": r"@\w[\w-]*\.\w",
    "IBAN_CODE": r"[A-Z]{2}\d\d",
    "CREDIT_CARD": _DIGIT_RUN,
    "IP_ADDRESS": (r"\.\d{1,3}\.\d{1,3}\.", r":[0-9A-Fa-f]{0,4}:"),  # inner ".d.d." of a dotted quad; IPv6 ":h:"
    "PHONE_NUMBER": _DIGIT_RUN,
    "FR_NIR": (_DIGIT_RUN, r"[12] ?\d\d ?\d\d ?2[AB]"),
    "DE_TAX_ID": _DIGIT_RUN,
    "DE_ID_CARD": r"[CFGHJKLMNPRTVWXYZ][CFGHJKLMNPRTVWXYZ0-9]{7}\d",  # covers the legacy T + 8 digits
    # codice fiscale: surname+name letters, year, month letter, day, town (letter + 3), check letter;
    # omocodia may turn any of the 7 digits into L-V
    "IT_FISCAL_CODE": r"[A-Za-z]{6}[0-9LMNP-Vlmnp-v]{2}[A-EHLMPR-Ta-ehlmpr-t][0-9LMNP-Vlmnp-v]{2}[A-MZa-mz]"
                      r"[0-9LMNP-Vlmnp-v]{3}[A-Za-z]",
}
# The `regex` engine scans these faster than `re` (measured on stdlib sources); same semantics.
FAST_WITH_REGEX = frozenset({TRIGGERS["IBAN_CODE"], _DIGIT_RUN})


def _builtin(config: "PiiConfig") -> dict[str, Callable[[], Detector]]:
    """entity -> zero-argument factory of its built-in detector (recognizers load on first use)."""
    t, regions = TRIGGERS, config.regions()
    return {
        "EMAIL_ADDRESS": lambda: PresidioDetector(_email_recognizer, "EMAIL_ADDRESS", t["EMAIL_ADDRESS"], rank=3,
                                                  glue=None, margin=256),
        "IBAN_CODE": lambda: PresidioDetector(_iban_recognizer, "IBAN_CODE", t["IBAN_CODE"], rank=5),
        "CREDIT_CARD": lambda: PresidioDetector(_card_recognizer, "CREDIT_CARD", t["CREDIT_CARD"], rank=3),
        "IP_ADDRESS": lambda: PresidioDetector(_ip_recognizer, "IP_ADDRESS", t["IP_ADDRESS"], rank=2, glue="."),
        "PHONE_NUMBER": lambda: PhoneDetector(functools.partial(_phone_recognizer, regions), "PHONE_NUMBER",
                                              t["PHONE_NUMBER"], rank=1, margin=16, params=",".join(regions)),
        "FR_NIR": lambda: PresidioDetector(_nir_recognizer, "FR_NIR", t["FR_NIR"], rank=5),
        "DE_TAX_ID": lambda: PresidioDetector(_de_tax_id_recognizer, "DE_TAX_ID", t["DE_TAX_ID"], rank=4),
        "DE_ID_CARD": lambda: PresidioDetector(_de_id_card_recognizer, "DE_ID_CARD", t["DE_ID_CARD"], rank=4),
        "IT_FISCAL_CODE": lambda: PresidioDetector(_it_fiscal_code_recognizer, "IT_FISCAL_CODE", t["IT_FISCAL_CODE"],
                                                   rank=4),
    }


def _iban_recognizer():
    from presidio_analyzer.predefined_recognizers import IbanRecognizer

    return IbanRecognizer()


def _load_plugin(name: str) -> Callable:
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"pii recognizer plug-in {name!r} cannot be imported: {e}") from e
    eps = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == name]
    if not eps:
        installed = sorted(ep.name for ep in entry_points(group=PLUGIN_GROUP))
        raise ValueError(f"no pii recognizer plug-in {name!r}: give 'pkg.module:factory' or an entry point "
                         f"of group {PLUGIN_GROUP} (installed: {installed})")
    return eps[0].load()


def build_detectors(config: "PiiConfig") -> list[Detector]:
    """The detectors a config asks for: built-ins by entity, the NER model, then plug-ins."""
    quiet_presidio()
    builtins = _builtin(config)
    out: list[Detector] = [builtins[e]() for e in config.entities if e in builtins]
    ner = [e for e in config.entities if e not in builtins]
    if ner:
        from .ner import load_ner

        out.extend(load_ner(config.ner_model, tuple(ner)))
    for name in config.recognizers:
        made = _load_plugin(name)(config)
        made = [made] if isinstance(made, Detector) else list(made)
        for d in made:
            if not isinstance(d, Detector):
                raise ValueError(f"pii recognizer plug-in {name!r} returned {type(d).__name__}, not a Detector")
        out.extend(made)
    return out


def detectors_fingerprint(detectors: Iterable[Detector]) -> str:
    h = hashlib.sha256()
    for d in sorted(x.fingerprint() for x in detectors):
        h.update(d.encode() + b"\0")
    return h.hexdigest()


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def quiet_presidio() -> None:
    """Presidio logs matched values (e.g. 'Failed to validate text <IBAN>'): a site's logs must not
    become a second copy of its PII, so its logger is silenced once a scrubber is built."""
    lg = logging.getLogger("presidio-analyzer")
    if not any(isinstance(f, _DropAll) for f in lg.filters):
        lg.addFilter(_DropAll())
