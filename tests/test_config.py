"""Every bad configuration is rejected before anything starts, naming the file, field and fix."""

from __future__ import annotations

import copy

import pytest

from conftest import sovfl, write_config
from federation.config.schema import ConfigError, load_config

GOOD = {
    "federation": {"name": "t", "rounds": 2, "quorum": 2},
    "workload": {"task": "digits"},
    "sites": [
        {"id": "a", "ranks": 2, "partition": 0},
        {"id": "b", "ranks": 1, "partition": 1},
    ],
}


def _with(path: list, value) -> dict:
    data = copy.deepcopy(GOOD)
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


_DELETE = object()

BAD = [
    ("unknown field", _with(["federation", "roundz"], 3), "federation.roundz", "unknown field"),
    ("rounds zero", _with(["federation", "rounds"], 0), "federation.rounds", "greater than or equal to 1"),
    ("bad strategy", _with(["federation", "strategy"], "fedsgd"), "federation.strategy", "fedavg"),
    ("bad update kind", _with(["federation", "update_kind"], "grads"), "federation.update_kind", "delta"),
    ("quorum too big", _with(["federation", "quorum"], 5), "quorum (5) exceeds the number of sites (2)", "lower it"),
    ("sample too big", _with(["federation", "sites_per_round"], 3), "sites_per_round (3) exceeds", ""),
    ("negative deadline", _with(["federation", "deadlines"], {"round_s": -1}), "federation.deadlines.round_s", "greater than 0"),
    ("no sites", _with(["sites"], []), "sites", "at least 1"),
    ("missing sites", _with(["sites"], _DELETE), "sites", "required; add it"),
    ("duplicate ids", _with(["sites", 1, "id"], "a"), "site ids must be unique", "'a'"),
    ("bad partitions", _with(["sites", 1, "partition"], 3), "partitions must be 0..1", ""),
    ("bad backend", _with(["sites", 0, "backend"], "mpi"), "sites.0.backend", "gloo"),
    ("zero lr", _with(["sites", 0, "lr"], 0), "sites.0.lr", "greater than 0"),
    ("bad site id", _with(["sites", 0, "id"], "a b"), "sites.0.id", "pattern"),
    ("bad workload", _with(["workload", "task"], "imagenet"), "workload.task", "digits"),
    ("bad downlink codec", _with(["federation", "downlink_codec"], "int9"), "federation.downlink_codec",
     "unknown codec stage 'int9'"),
    ("heads", _with(["workload"], {"task": "slm", "options": {"n_embd": 30, "n_head": 4}}), "divisible by n_head", ""),
    ("attestation without verifiers", _with(["federation", "attestation"], {"enabled": True}),
     "coordinator.sites.verifiers is empty", "dev_issuer"),
    ("attestation override of unknown site", _with(["federation", "attestation"], {
        "enabled": True, "dev_issuer": True, "site_overrides": {"zz": {}}}), "unknown site(s) ['zz']", "sites: ['a', 'b']"),
    ("attestation site typo", _with(["federation", "attestation"], {
        "enabled": True, "dev_issuer": True, "site": {"verify_coordinater": False}}), "for site a", "verify_coordinater"),
    ("coordinator unattested", _with(["federation", "attestation"], {
        "enabled": True, "coordinator": {"sites": {"verifiers": {"eat-jwt": {}}}}}), "coordinator.attester is unset",
     "verify_coordinator: false"),
]


@pytest.mark.parametrize("label,data,where,hint", BAD, ids=[b[0] for b in BAD])
def test_bad_config_rejected_with_field_and_fix(tmp_path, label, data, where, hint):
    path = write_config(tmp_path / "bad.yaml", data)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert str(path) in text and where in text and hint in text


def test_good_config_loads(tmp_path):
    cfg = load_config(write_config(tmp_path / "ok.yaml", GOOD))
    assert [s.id for s in cfg.sites] == ["a", "b"] and cfg.federation.effective_server_lr == 1.0


def test_yaml_syntax_and_missing_file(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("federation: {rounds: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level"):
        load_config(tmp_path / "list.yaml")


def test_cli_rejects_before_starting_anything(tmp_path, marker):
    path = write_config(tmp_path / "bad.yaml", _with(["federation", "quorum"], 9))
    proc = sovfl("simulate", str(path), "--workdir", str(tmp_path / "run"), env={"SOVFL_RUN_MARKER": marker})
    assert proc.returncode == 2
    assert "quorum (9)" in proc.stderr and str(path) in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_shipped_configs_are_valid():
    from conftest import ROOT

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)
