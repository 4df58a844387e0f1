"""The three actions (mask, replace, drop_document), the optional local NER models (a spaCy
pipeline and a Hugging Face token classifier, both built here, nothing downloaded), plug-ins."""

from __future__ import annotations

import ipaddress
import re

import pytest

from site_trainer.pii import CorpusScrubber, PiiConfig
from site_trainer.pii.ner import NerModelError
from site_trainer.pii.recognizers import Detector, Span, card_issuer_ok, nir_key_ok
from site_trainer.pii.scrubber import Scrubber
from site_trainer.pii.surrogates import Surrogates

TEXT = ("Jean Dupont (jean.dupont@orange.fr, +33 1 43 38 83 68) paie avec la carte 4111 1111 1111 1111 "
        "depuis 81.2.69.160 et 2a02:8428:1b2c::42. IBAN FR14 5957 4890 6828 8360 7598 386, "
        "NIR 1 84 12 76 451 089 46, Steuer-ID 86095742719, Ausweis L01X00T44, CF RSSMRA85T10A562S.")
FOUND = {"EMAIL_ADDRESS": "jean.dupont@orange.fr", "PHONE_NUMBER": "+33 1 43 38 83 68",
         "CREDIT_CARD": "4111 1111 1111 1111", "IP_ADDRESS": "81.2.69.160", "IBAN_CODE": "FR14 5957 4890 6828 8360 7598 386",
         "FR_NIR": "1 84 12 76 451 089 46", "DE_TAX_ID": "86095742719", "DE_ID_CARD": "L01X00T44",
         "IT_FISCAL_CODE": "RSSMRA85T10A562S"}


@pytest.fixture(scope="module")
def mask() -> Scrubber:
    return Scrubber(PiiConfig())


def test_every_pattern_entity_found_once(mask):
    spans = mask.analyze(TEXT)
    got = {s.entity: TEXT[s.start:s.end] for s in spans}
    assert got.pop("IP_ADDRESS") in ("81.2.69.160", "2a02:8428:1b2c::42")
    assert {k: v for k, v in got.items()} == {k: v for k, v in FOUND.items() if k != "IP_ADDRESS"}
    assert sum(s.entity == "IP_ADDRESS" for s in spans) == 2 and len(spans) == len(FOUND) + 1


def test_mask_replaces_each_value_by_its_type(mask):
    res = mask.scrub(TEXT)
    for ent, v in FOUND.items():
        assert v not in res.text and f"<{ent}>" in res.text
    assert res.text.startswith("Jean Dupont (<EMAIL_ADDRESS>, <PHONE_NUMBER>) paie avec la carte <CREDIT_CARD> ")
    assert res.counts["IP_ADDRESS"] == 2 and res.touched and not res.dropped


def test_replace_gives_surrogates_of_the_same_shape_that_are_nobodys():
    sc = Scrubber(PiiConfig(action="replace"), surrogate_key=b"k" * 32)
    out = sc.scrub(TEXT).text
    for v in FOUND.values():
        assert v not in out
    # nothing a second pass would count again except what is valid by nature (e-mail, IP, phone)
    again = {s.entity for s in sc.analyze(out)}
    assert again <= {"EMAIL_ADDRESS", "IP_ADDRESS", "PHONE_NUMBER"}, again
    sur = Surrogates(b"k" * 32, {d.entity: d for d in sc.detectors})
    email = sur.make("EMAIL_ADDRESS", "jean.dupont@orange.fr")
    assert re.fullmatch(r"[a-z]{4}\.[a-z]{6}@example\.(org|com|net)", email)
    ip4, ip6 = sur.make("IP_ADDRESS", "81.2.69.160"), sur.make("IP_ADDRESS", "2a02:8428:1b2c::42")
    assert any(ipaddress.ip_address(ip4) in ipaddress.ip_network(n)
               for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24"))
    assert ipaddress.ip_address(ip6) in ipaddress.ip_network("2001:db8::/32")
    card = sur.make("CREDIT_CARD", "4111 1111 1111 1111")
    assert re.fullmatch(r"\d{4} \d{4} \d{4} \d{4}", card) and card != "4111 1111 1111 1111"
    assert not (card_issuer_ok(card.replace(" ", "")) and sc.analyze(f" {card} "))
    iban = sur.make("IBAN_CODE", "FR14 5957 4890 6828 8360 7598 386")
    assert iban.startswith("FR") and len(iban) == 33 and not sc.analyze(f" {iban} ")
    nir = sur.make("FR_NIR", "1 84 12 76 451 089 46")
    assert len(nir) == 21 and not nir_key_ok(nir)
    # co-reference kept: the same value, the same surrogate; another site key, another surrogate
    assert sur.make("EMAIL_ADDRESS", "jean.dupont@orange.fr") == email
    assert Surrogates(b"x" * 32).make("EMAIL_ADDRESS", "jean.dupont@orange.fr") != email
    assert sc.scrub(TEXT).text == out


def test_drop_document_drops_only_documents_with_findings(tmp_path):
    scrub = CorpusScrubber(PiiConfig(action="drop_document"))
    assert scrub("a.txt", TEXT) is None
    assert scrub("b.txt", "Rien de personnel ici.") == "Rien de personnel ici."
    rep = scrub.finish()
    assert rep.documents == 2 and rep.documents_dropped == 1 and rep.documents_touched == 1
    assert rep.counts["CREDIT_CARD"] == 1 and rep.samples["CREDIT_CARD"]  # the reviewer still sees why


def test_spacy_ner_pipeline_from_a_local_directory(tmp_path):
    import spacy

    nlp = spacy.blank("fr")
    ruler = nlp.add_pipe("entity_ruler")
    ruler.add_patterns([{"label": "PER", "pattern": "Jean Dupont"}, {"label": "LOC", "pattern": "Lyon"}])
    nlp.to_disk(tmp_path / "ner")
    sc = Scrubber(PiiConfig(entities=["EMAIL_ADDRESS", "PERSON", "LOCATION"], ner_model=tmp_path / "ner"))
    out = sc.scrub("Jean Dupont habite Lyon, jean.dupont@orange.fr.").text
    assert out == "<PERSON> habite <LOCATION>, <EMAIL_ADDRESS>."
    # PERSON only: places stay
    sc = Scrubber(PiiConfig(entities=["PERSON"], ner_model=tmp_path / "ner"))
    assert sc.scrub("Jean Dupont habite Lyon.").text == "<PERSON> habite Lyon."
    fp = sc.fingerprint
    ruler.add_patterns([{"label": "PER", "pattern": "Anna"}])
    nlp.to_disk(tmp_path / "ner")
    assert Scrubber(PiiConfig(entities=["PERSON"], ner_model=tmp_path / "ner")).fingerprint != fp  # model in key


def _hf_token_classifier(path, favour: str):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import BertConfig, BertForTokenClassification, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["Jean Dupont habite Lyon et écrit à Anna.", "Bonjour à tous."] * 10,
                            trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   pad_token="[PAD]", model_max_length=64)
    labels = ["O", "B-PER", "I-PER"]
    cfg = BertConfig(vocab_size=fast.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64, num_labels=3,
                     id2label=dict(enumerate(labels)), label2id={x: i for i, x in enumerate(labels)})
    model = BertForTokenClassification(cfg)
    with torch.no_grad():  # a classifier that answers `favour` for every token, whatever its input
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([10.0 if x == favour else 0.0 for x in labels]))
    model.save_pretrained(path)
    fast.save_pretrained(path)


def test_hf_token_classification_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _hf_token_classifier(tmp_path / "per", "B-PER")
    _hf_token_classifier(tmp_path / "none", "O")
    text = "Jean Dupont habite Lyon."
    every = Scrubber(PiiConfig(entities=["PERSON"], ner_model=tmp_path / "per"))
    spans = every.analyze(text)
    assert spans and {s.entity for s in spans} == {"PERSON"}
    assert re.fullmatch(r"(<PERSON>\W*)+", every.scrub(text).text)  # every word was a name
    nothing = Scrubber(PiiConfig(entities=["PERSON"], ner_model=tmp_path / "none"))
    assert nothing.analyze(text) == [] and nothing.scrub(text).text == text


def test_missing_or_wrong_ner_model_is_a_clear_error(tmp_path):
    with pytest.raises(NerModelError, match="does not exist on this site"):
        Scrubber(PiiConfig(entities=["PERSON"], ner_model=tmp_path / "absent"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "weights.bin").write_bytes(b"\0")
    with pytest.raises(NerModelError, match="neither a spaCy pipeline"):
        Scrubber(PiiConfig(entities=["PERSON"], ner_model=tmp_path / "junk"))


class _Customer(Detector):
    """A plug-in: this bank's customer numbers (CUST- and 8 digits)."""

    entity, trigger, rank = "CUSTOMER_ID", r"CUST-", 3

    def find(self, text):
        return [Span(m.start(), m.end(), self.entity, 1.0) for m in re.finditer(r"\bCUST-\d{8}\b", text)]


def customer(config):
    return _Customer()


def test_user_detector_plugs_in_like_a_builtin():
    sc = Scrubber(PiiConfig(entities=["EMAIL_ADDRESS"], recognizers=[f"{__name__}:customer"]))
    res = sc.scrub("Client CUST-12345678, a@orange.fr.")
    assert res.text == "Client <CUSTOMER_ID>, <EMAIL_ADDRESS>." and res.counts["CUSTOMER_ID"] == 1
