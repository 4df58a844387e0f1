"""`PiiConfig`: what a site scrubs from its text before tokenization, and how.

Pydantic only, no Presidio import: the federation's schema (`sites[].pii`) validates this on the
coordinator, where neither the corpus nor the NER model exists. Paths are therefore checked when
the scrubber is built on the site, not here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Entities found by patterns and validators: no model, no download. `True`: the match is checked
# beyond its shape (a checksum, a public suffix, a parsed address): these carry the recall and
# false-positive targets (see README.md).
PATTERN_ENTITIES: dict[str, bool] = {
    "EMAIL_ADDRESS": True,   # RFC 5322-ish shape + a public suffix from tldextract's bundled list
    "IBAN_CODE": True,       # ISO 13616 mod-97 + the country's BBAN format
    "CREDIT_CARD": True,     # Luhn + issuer prefix and length (ISO/IEC 7812)
    "IP_ADDRESS": True,      # parsed by `ipaddress`; loopback and unspecified are not personal
    "PHONE_NUMBER": False,   # `phonenumbers` metadata of the regions (valid numbering plan, no checksum)
    "FR_NIR": False,         # numéro de sécurité sociale (INSEE): 13 digits + mod-97 key
    "DE_TAX_ID": False,      # Steueridentifikationsnummer: ISO 7064 mod 11,10 check digit
    "DE_ID_CARD": False,     # Personalausweis (nPA): ICAO 9303 check digit
    "IT_FISCAL_CODE": False, # codice fiscale: check character
}
VALIDATED_ENTITIES = tuple(name for name, checked in PATTERN_ENTITIES.items() if checked)
# Entities only a NER model finds (optional, `ner_model`).
NER_ENTITIES = ("PERSON", "LOCATION")
KNOWN_ENTITIES = (*PATTERN_ENTITIES, *NER_ENTITIES)

# Phone numbering plans tried for numbers written without a country code, per text language.
REGIONS_BY_LANGUAGE: dict[str, tuple[str, ...]] = {
    "en": ("GB", "IE"),
    "fr": ("FR", "BE", "CH"),  # not LU: its plan has no trunk prefix and accepts most 6-11 digit numbers
    "de": ("DE", "AT", "CH"),
    "it": ("IT",),
    "es": ("ES",),
    "nl": ("NL", "BE"),
    "pt": ("PT",),
    "pl": ("PL",),
}


class PiiConfig(BaseModel):
    """One site's PII scrubbing. The default is safe: on, every pattern entity, masked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="scrub this site's text before tokenization")
    entities: tuple[str, ...] = Field(
        tuple(PATTERN_ENTITIES),
        description=f"entity types to scrub; pattern entities {list(PATTERN_ENTITIES)}, "
                    f"and with a NER model {list(NER_ENTITIES)}")
    action: Literal["mask", "replace", "drop_document"] = Field(
        "mask", description="mask: the span becomes <ENTITY_TYPE>; replace: a surrogate of the same shape "
                            "that is nobody's (reserved domains and ranges, failing checksums); "
                            "drop_document: a document with any finding is left out")
    ner_model: Path | None = Field(
        None, description="local NER model for PERSON/LOCATION: a spaCy pipeline directory (nlp.to_disk or "
                          "an installed package's data dir) or a Hugging Face token-classification directory")
    languages: tuple[str, ...] = Field(("en", "fr", "de", "it"), description="ISO 639-1 codes of the site's text")
    phone_regions: tuple[str, ...] | None = Field(
        None, description="ISO 3166 regions whose national numbering plans are tried for numbers written "
                          "without +country; None: derived from `languages`")
    recognizers: tuple[str, ...] = Field(
        (), description="extra detectors (plug-ins): 'pkg.module:factory' or an entry point name in "
                        "group sovereign_fl.pii_recognizers; factory(config) -> Detector | list[Detector]")
    workers: int | None = Field(None, ge=1, description="processes scrubbing in parallel; None: every core of the site")
    sample_per_entity: int = Field(20, ge=0, le=1000, description="redaction samples kept per entity in the report")
    doc_timeout_s: float | None = Field(
        600.0, gt=0, description="a document not scrubbed within this many seconds is dropped and reported "
                                 "(never passed on unscrubbed); None: no limit")

    @field_validator("entities", mode="before")
    @classmethod
    def _upper(cls, v):
        return tuple(dict.fromkeys(str(x).strip().upper() for x in v)) if isinstance(v, (list, tuple)) else v

    @field_validator("languages", mode="before")
    @classmethod
    def _lower(cls, v):
        return tuple(dict.fromkeys(str(x).strip().lower() for x in v)) if isinstance(v, (list, tuple)) else v

    @field_validator("phone_regions", mode="before")
    @classmethod
    def _regions(cls, v):
        return tuple(dict.fromkeys(str(x).strip().upper() for x in v)) if isinstance(v, (list, tuple)) else v

    @model_validator(mode="after")
    def _consistent(self) -> "PiiConfig":
        unknown = [e for e in self.entities if e not in KNOWN_ENTITIES]
        if unknown:
            raise ValueError(f"unknown PII entities {unknown}; known: {list(KNOWN_ENTITIES)} "
                             f"(other types come from plug-ins listed in `recognizers`)")
        ner = [e for e in self.entities if e in NER_ENTITIES]
        if ner and self.ner_model is None:
            raise ValueError(f"{ner} are found only by a NER model: set ner_model to a local spaCy pipeline or "
                             f"Hugging Face token-classification directory, or remove them from entities")
        if self.enabled and not self.entities and not self.recognizers:
            raise ValueError("pii is enabled with no entities and no recognizers: list entities or set enabled: false")
        bad = [x for x in self.languages if not re.fullmatch(r"[a-z]{2}", x)]
        if bad:
            raise ValueError(f"languages must be ISO 639-1 codes such as 'fr', got {bad}")
        if self.phone_regions is not None:
            import phonenumbers  # small, pure Python; a dependency of presidio-analyzer

            wrong = [r for r in self.phone_regions if r not in phonenumbers.SUPPORTED_REGIONS]
            if wrong:
                raise ValueError(f"phone_regions {wrong} are not ISO 3166 regions known to phonenumbers")
        return self

    def regions(self) -> tuple[str, ...]:
        """The numbering plans tried for national-format phone numbers."""
        if self.phone_regions is not None:
            return self.phone_regions
        out = [r for lang in self.languages for r in REGIONS_BY_LANGUAGE.get(lang, ())]
        return tuple(dict.fromkeys(out)) or ("GB",)
