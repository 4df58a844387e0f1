"""PiiConfig: the safe default, clear errors, and an import that stays light (coordinator side)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from site_trainer.pii import NER_ENTITIES, PATTERN_ENTITIES, VALIDATED_ENTITIES, PiiConfig


def test_default_is_on_every_pattern_entity_masked():
    cfg = PiiConfig()
    assert cfg.enabled and cfg.action == "mask" and cfg.ner_model is None
    assert cfg.entities == tuple(PATTERN_ENTITIES)
    assert set(VALIDATED_ENTITIES) == {"EMAIL_ADDRESS", "IBAN_CODE", "CREDIT_CARD", "IP_ADDRESS"}
    assert not set(cfg.entities) & set(NER_ENTITIES)
    # numbering plans for national-format phone numbers follow the languages
    assert PiiConfig(languages=["de"]).regions() == ("DE", "AT", "CH")
    assert PiiConfig(languages=["fr", "de"], phone_regions=["lu"]).regions() == ("LU",)


def test_yaml_style_values_are_normalised():
    cfg = PiiConfig.model_validate({"entities": ["email_address", " IBAN_CODE", "email_address"],
                                    "languages": ["FR"], "action": "drop_document"})
    assert cfg.entities == ("EMAIL_ADDRESS", "IBAN_CODE") and cfg.languages == ("fr",)


@pytest.mark.parametrize("data, words", [
    ({"entities": ["EMAIL", "IBAN_CODE"]}, ["unknown PII entities", "'EMAIL'", "EMAIL_ADDRESS"]),
    ({"entities": ["PERSON"]}, ["ner_model", "PERSON"]),
    ({"languages": ["french"]}, ["ISO 639-1", "french"]),
    ({"phone_regions": ["XX"]}, ["phone_regions", "XX"]),
    ({"action": "redact"}, ["action"]),
    ({"entites": ["IBAN_CODE"]}, ["entites"]),
    ({"entities": []}, ["no entities"]),
    ({"workers": 0}, ["workers"]),
])
def test_bad_config_says_what_is_wrong(data, words):
    with pytest.raises(ValidationError) as e:
        PiiConfig.model_validate(data)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_disabled_needs_nothing():
    assert not PiiConfig(enabled=False, entities=[]).enabled


def test_config_and_metrics_import_without_presidio_or_torch():
    """The federation's schema imports PiiConfig on the coordinator; round_metrics is called next to
    the torch-free relay. Neither may pull Presidio (which imports spaCy, transformers and torch)."""
    code = ("import sys; from site_trainer.pii import PiiConfig, round_metrics; PiiConfig(); "
            "from site_trainer.pii.report import ScrubReport; round_metrics(ScrubReport(entities=('IBAN_CODE',))); "
            "bad = [m for m in ('presidio_analyzer', 'presidio_anonymizer', 'spacy', 'torch', 'transformers') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_scrubber_and_its_fingerprint_exist_before_presidio_loads(tmp_path):
    """The text data path asks for the fingerprint (its cache key) before it knows whether anything
    must be scrubbed; that must not cost Presidio's import. The fingerprint follows every setting
    that changes the output."""
    code = (f"import sys; from pathlib import Path; from site_trainer.pii import CorpusScrubber, PiiConfig\n"
            f"fp = lambda **k: CorpusScrubber(PiiConfig(**k), cache_dir=Path({str(tmp_path)!r})).fingerprint\n"
            f"prints = [fp(), fp(), fp(languages=['de']), fp(action='replace'), fp(entities=['IBAN_CODE']), "
            f"fp(sample_per_entity=3)]\n"
            f"assert prints[0] == prints[1] and len(set(prints)) == 5, prints\n"
            f"bad = [m for m in ('presidio_analyzer', 'spacy', 'torch') if m in sys.modules]\n"
            f"assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
