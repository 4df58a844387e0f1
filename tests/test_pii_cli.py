"""`python -m site_trainer.pii`: inputs, configuration files, and errors that say what to do.
(Its full run, with worker processes and the network denied, is in test_pii_network.py.)"""

from __future__ import annotations

import subprocess
import sys

from site_trainer.pii import expand_inputs
from site_trainer.pii.__main__ import _parser, load_config


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "site_trainer.pii", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_inputs_are_files_directories_or_globs(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for rel in ("a/x.txt", "a/b/y.md", "a/.hidden/z.txt", "top.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    names = lambda ps: sorted(str(p.relative_to(tmp_path)) for p in ps)  # noqa: E731
    assert names(expand_inputs(["a"], tmp_path)) == ["a/b/y.md", "a/x.txt"]
    assert names(expand_inputs(["**/*.txt"], tmp_path)) == ["a/.hidden/z.txt", "a/x.txt", "top.txt"]
    assert names(expand_inputs(["top.txt", str(tmp_path / "top.txt"), "nothing*"], tmp_path)) == ["top.txt"]


def test_config_file_and_flags(tmp_path):
    (tmp_path / "site.yaml").write_text("pii:\n  action: replace\n  languages: [de]\n  entities: [IBAN_CODE, PHONE_NUMBER]\n")
    cfg = load_config(_parser().parse_args(["x", "--config", str(tmp_path / "site.yaml")]))
    assert cfg.action == "replace" and cfg.regions() == ("DE", "AT", "CH") and cfg.entities == ("IBAN_CODE", "PHONE_NUMBER")
    cfg = load_config(_parser().parse_args(["x", "--config", str(tmp_path / "site.yaml"), "--entities",
                                            "email_address", "--action", "mask"]))
    assert cfg.entities == ("EMAIL_ADDRESS",) and cfg.action == "mask"


def test_bad_configuration_or_no_input_exits_1_with_the_reason(tmp_path):
    r = _cli(str(tmp_path), "--entities", "EMAIL", cwd=tmp_path)
    assert r.returncode == 1 and "unknown PII entities" in r.stderr and "EMAIL_ADDRESS" in r.stderr
    r = _cli(str(tmp_path), "--entities", "PERSON", cwd=tmp_path)
    assert r.returncode == 1 and "ner_model" in r.stderr
    r = _cli(str(tmp_path / "nothing-*.txt"), cwd=tmp_path)
    assert r.returncode == 1 and "no files match" in r.stderr
    assert not (tmp_path / ".sovfl-pii").exists()
