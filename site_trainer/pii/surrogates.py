"""Surrogates for `action: replace`: values of the same shape that belong to nobody.

A language model trained on `<EMAIL_ADDRESS>` learns the placeholder; one trained on surrogates
keeps the text's natural form. Each surrogate is drawn from an RNG seeded by
HMAC-SHA256(site key, entity, value): the same value maps to the same surrogate everywhere in the
corpus (co-reference survives), and without the site's key nobody can enumerate candidate values
(phone numbers, IDs) to invert the mapping. The key never leaves the site; only its id enters
cache fingerprints.

- e-mail: random local part of the same shape @ example.org/com/net (RFC 2606, reserved);
- IP: TEST-NET-1/2/3 (RFC 5737) or 2001:db8::/32 (RFC 3849), reserved for documentation;
- checksum entities (cards, IBAN, national IDs): same shape, redrawn until the entity's own
  detector rejects it, so the surrogate is no valid number and a second pass does not count it;
- phone numbers: country code and trunk prefix kept, other digits random (no reserved range
  exists across the EU numbering plans: a surrogate may be dialable, but is unrelated to the
  person in the text);
- anything else (names from a NER model, plug-in entities): pronounceable letters and random
  digits of the same shape.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import re
from collections.abc import Callable, Mapping

from .detector import Detector

CHECKSUMMED = ("CREDIT_CARD", "IBAN_CODE", "FR_NIR", "DE_TAX_ID", "DE_ID_CARD", "IT_FISCAL_CODE")
_VOWELS, _CONSONANTS = "aeiou", "bcdfghjklmnprstvz"


def _same_shape(value: str, rng: random.Random, keep: int = 0) -> str:
    out = list(value[:keep])
    for i, c in enumerate(value[keep:]):
        if c.isdigit():
            out.append(str(rng.randrange(10)))
        elif c.isalpha():
            ch = rng.choice(_VOWELS if i % 2 else _CONSONANTS)
            out.append(ch.upper() if c.isupper() else ch)
        else:
            out.append(c)
    return "".join(out)


class Surrogates:
    def __init__(self, key: bytes | None, detectors: Mapping[str, Detector] | None = None):
        self.key = key if key is not None else os.urandom(32)
        self.key_id = hashlib.sha256(b"sovfl-pii-surrogate-key" + self.key).hexdigest()[:16]
        self.detectors = dict(detectors or {})

    def _rng(self, entity: str, value: str) -> random.Random:
        seed = hmac.new(self.key, f"{entity}\0{value}".encode(), hashlib.sha256).digest()
        return random.Random(seed)

    def for_entity(self, entity: str) -> Callable[[str], str]:
        return lambda value: self.make(entity, value)

    def make(self, entity: str, value: str) -> str:
        rng = self._rng(entity, value)
        if entity == "EMAIL_ADDRESS" and "@" in value:
            local = value.rsplit("@", 1)[0]
            return f"{_same_shape(local, rng)}@example.{rng.choice(('org', 'com', 'net'))}"
        if entity == "IP_ADDRESS":
            return self._ip(value, rng)
        if entity == "PHONE_NUMBER":
            m = re.match(r"^(\+\d{1,3}|00\d{1,3}|\(?0)?", value)
            return _same_shape(value, rng, keep=len(m.group(0)) if m else 0)
        if entity == "IBAN_CODE":
            return self._until_rejected(entity, lambda: value[:2] + _same_shape(value[2:], rng))
        if entity in CHECKSUMMED:
            return self._until_rejected(entity, lambda: _same_shape(value, rng))
        return _same_shape(value, rng)

    def _until_rejected(self, entity: str, draw: Callable[[], str]) -> str:
        det = self.detectors.get(entity)
        for _ in range(64):
            s = draw()
            if det is None or not det.find(f" {s} "):
                return s
        return s  # pragma: no cover - 64 draws that all pass a checksum: p < 10^-64

    @staticmethod
    def _ip(value: str, rng: random.Random) -> str:
        addr, slash, prefix = value.partition("/")
        if ":" in addr and "." not in addr:
            out = "2001:db8:" + ":".join(f"{rng.randrange(1 << 16):x}" for _ in range(6))
        else:
            net = rng.choice(("192.0.2", "198.51.100", "203.0.113"))
            out = f"{net}.{rng.randrange(1, 255)}"
        return out + (slash + prefix if slash else "")
