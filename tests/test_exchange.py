"""What travels: only the exchanged tensors, tied ones once, integer buffers never, shapes and bf16
bits kept; the manifest and the fingerprint of the frozen weights. One rank here (a real gloo
group of one); the same under ddp/zero2/zero3 on two ranks is in tests/test_workers.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from site_trainer import handoff, layout, workloads
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.session import Session
from site_trainer.workload import TaskContext
from site_trainer.workload_loader import build_task

TOY = "user_tasks:Toy"


@pytest.fixture
def group(single_rank_group):
    yield


def _cfg(tmp_path, **options) -> TrainerConfig:
    return TrainerConfig(site=SiteConfig(id="s", partition=0), workload=WorkloadConfig(task=TOY, options=options),
                         num_partitions=1, socket=str(tmp_path / "s.sock"), workdir=str(tmp_path))


def _site_model(cfg: TrainerConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_task(cfg.workload, TaskContext(role="site"), cfg.options).build_model()


def test_lora_like_model_exchanges_only_the_adapters(group, tmp_path):
    cfg = _cfg(tmp_path)
    sess = Session(_site_model(cfg), cfg)
    names = sess.layout.names
    assert names == ["gain"] + [f"blocks.{i}.{p}" for i in range(3) for p in ("lora_a", "lora_b")]
    frozen = set(sess.layout.frozen)
    assert {"emb.weight", "head.weight", "calls", "centre", "blocks.0.base.weight"} <= frozen
    assert "inv_freq" not in frozen  # non-persistent: in no state dict, made by the constructor
    init = workloads.initial_weights(cfg.workload, 0)
    assert list(init) == names  # the coordinator's initial model: the adapters, not the base
    assert sess.manifest == workloads.manifest(cfg.workload, 0)
    assert sess.manifest["exchanged_numel"] == sum(a.size for a in init.values())


def test_integer_buffers_stay_and_zero_dim_shapes_travel(group, tmp_path):
    cfg = _cfg(tmp_path)
    model = _site_model(cfg)
    sess = Session(model, cfg)
    model.calls.fill_(5)
    init = workloads.initial_weights(cfg.workload, 0)
    assert init["gain"].shape == () and sess.layout.wire_spec()["gain"] == ("<f4", ())
    glob = {k: v + 1 for k, v in init.items()}
    assert sess.load(glob) == {}
    assert int(model.calls) == 5  # the integer buffer was not touched
    back = sess.full_state()
    assert back["gain"].shape == () and float(back["gain"]) == float(init["gain"]) + 1
    for k in init:
        np.testing.assert_array_equal(back[k], glob[k])
    with pytest.raises(layout.LayoutError, match="integer buffers .* stay on the site"):
        Session(model, cfg, exchanged=["gain", "calls"])


def test_tied_weights_travel_once_and_stay_tied(group, tmp_path):
    cfg = _cfg(tmp_path, lora=False)
    model = _site_model(cfg)
    sess = Session(model, cfg)
    assert "emb.weight" in sess.layout.names and "head.weight" not in sess.layout.names
    assert "head.weight" not in sess.layout.frozen  # an alias of an exchanged tensor is not frozen either
    glob = {k: v.copy() for k, v in workloads.initial_weights(cfg.workload, 0).items()}
    glob["emb.weight"] = np.full_like(glob["emb.weight"], 0.25)
    assert sess.load(glob) == {}
    assert model.head.weight is model.emb.weight and float(model.head.weight.detach().mean()) == 0.25
    # asked for both names, it still travels once
    assert Session(model, cfg, exchanged=["emb.weight", "head.weight", "gain"]).layout.names == ["emb.weight", "gain"]


def test_bf16_travels_as_raw_words_bit_exact(group, tmp_path):
    cfg = _cfg(tmp_path, dtype="bfloat16")
    model = _site_model(cfg)
    sess = Session(model, cfg)
    spec = sess.layout.wire_spec()
    assert all(wire == "<u2" for wire, _ in spec.values())
    assert sess.manifest["exchanged"][0][1] == "bfloat16" and sess.manifest["exchanged"][0][3] == "<u2"
    rng = np.random.default_rng(0)
    words = {k: rng.integers(0, 2**16, size=shape, dtype=np.uint16) for k, (_, shape) in spec.items()}
    for w in words.values():  # keep them finite: clear the exponent's top bit (no NaN/Inf patterns)
        w &= np.uint16(0xBFFF)
    h = handoff.write_arrays(words, "bf16")
    try:
        reader = handoff.Reader(h)
        assert sess.load(reader) == {}
        reader.close()
    finally:
        handoff.release(h.path)
    back = sess.full_state()
    for k in words:
        assert back[k].dtype == np.uint16
        np.testing.assert_array_equal(back[k], words[k])  # every bit back
    # a float32 global for a bf16 tensor (a coordinator accumulating in float32) is rounded on load
    f32 = {k: rng.normal(size=shape).astype(np.float32) for k, (_, shape) in spec.items()}
    assert sess.load(f32) == {}
    for k, t in layout.named_tensors(model).items():
        if k in f32:
            assert t.dtype == torch.bfloat16
            torch.testing.assert_close(t.float(), torch.from_numpy(f32[k]).bfloat16().float(), rtol=0, atol=0)


def test_non_finite_global_is_refused_by_name(group, tmp_path):
    cfg = _cfg(tmp_path)
    sess = Session(_site_model(cfg), cfg)
    glob = workloads.initial_weights(cfg.workload, 0)
    glob["blocks.1.lora_b"] = np.full_like(glob["blocks.1.lora_b"], np.inf)
    assert sess.load(glob) == {"blocks.1.lora_b": "contains NaN or Inf"}


def test_manifest_mismatch_names_the_frozen_base(group, tmp_path):
    coord = workloads.manifest(WorkloadConfig(task=TOY), 0)
    same = workloads.manifest(WorkloadConfig(task=TOY), 123)  # another seed: other adapters, same base
    other = workloads.manifest(WorkloadConfig(task=TOY, options={"base_seed": 8}), 0)
    assert layout.manifest_mismatch(coord, same) is None
    why = layout.manifest_mismatch(coord, other)
    assert why.startswith("frozen base weights differ") and "coordinator's base model" in why
    wider = workloads.manifest(WorkloadConfig(task=TOY, options={"d": 4}), 0)
    assert "exchanged tensor blocks.0.lora_a" in layout.manifest_mismatch(coord, wider)


def test_find_blocks_generic():
    from site_trainer.strategies import find_blocks
    from user_tasks import ToyLM, ToyOptions

    model = ToyLM(ToyOptions())
    assert find_blocks(model) == list(model.blocks)
    model._no_split_modules = ["ToyBlock"]  # how Hugging Face models name their decoder layers
    assert find_blocks(model) == list(model.blocks)
    assert find_blocks(torch.nn.Linear(2, 2)) == []


# ---- two ranks: ddp, zero2, zero3 ------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    """tests/exchange_worker.py once under torchrun (2 ranks): every parallelism's results."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    tmp = tmp_path_factory.mktemp("exchange")
    out = tmp / "out.npz"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "tests" / "exchange_worker.py"), str(out), str(tmp)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


PARALLELISMS = ("ddp", "zero2", "zero3")


def test_frozen_weights_streamed_to_every_rank_with_one_fingerprint(ranks2):
    """Under ZeRO every rank built parameters on the meta device and got the frozen weights from
    rank 0's real build; under ddp from DDP's broadcast. Each rank holds exactly the coordinator's
    base (equal fingerprints across ranks and parallelisms), the constructor-made buffer survived
    the meta build, and training moved the adapters but not the base."""
    coord = workloads.manifest(WorkloadConfig(task=TOY), 0)["frozen"]["sha256"]
    for par in PARALLELISMS:
        assert str(ranks2[f"{par}/manifest_sha"]) == coord, par
        assert list(ranks2[f"{par}/held_sha"]) == [coord, coord], par
        assert list(ranks2[f"{par}/held_sha_after"]) == [coord, coord], par
        assert list(ranks2[f"{par}/inv_freq_ok"]) == ["True", "True"], par
        digests = ranks2[f"{par}/digests"]
        assert len(digests) == 2 and digests[0] == digests[1], par


def test_adapters_train_the_same_under_every_parallelism(ranks2):
    init = workloads.initial_weights(WorkloadConfig(task=TOY), 0)
    got = {par: {k: ranks2[f"{par}/adapters/{k}"] for k in init} for par in PARALLELISMS}
    assert max(float(np.abs(got["ddp"][k] - init[k]).max()) for k in init) > 1e-3  # they trained
    for par in ("zero2", "zero3"):
        assert max(float(np.abs(got[par][k] - got["ddp"][k]).max()) for k in init) <= 1e-5, par


def test_full_fine_tuning_sends_the_tied_embedding_once(ranks2):
    for par in PARALLELISMS:
        names = list(ranks2[f"{par}/full_names"])
        assert "emb.weight" in names and "head.weight" not in names, par
        assert list(ranks2[f"{par}/full_tied"]) == ["True", "True"], par
        assert ranks2[f"{par}/full_digests"][0] == ranks2[f"{par}/full_digests"][1], par
        emb = ranks2[f"{par}/full/emb.weight"]
        assert np.abs(emb - ranks2[f"ddp/full/emb.weight"]).max() <= 1e-5, par


def test_a_bad_report_on_one_rank_raises_on_every_rank(ranks2):
    assert list(ranks2["misuse"]) == ["rank 1: report(acc='high'): metrics must be numbers or 1-element tensors"] * 2


def test_session_refuses_misuse(group, tmp_path):
    from site_trainer.session import SessionError

    cfg = _cfg(tmp_path)
    sess = Session(_site_model(cfg), cfg)
    h = handoff.write_arrays(workloads.initial_weights(cfg.workload, 0), "misuse")
    request = {"round": 4, "global": h.to_json(), "config": {}}
    try:
        with pytest.raises(SessionError, match="reported twice"):
            sess.serve_one("Train", request, lambda rnd: (rnd.report(num_examples=1, loss=1.0),
                                                          rnd.report(num_examples=1)))
        # the first report answered with an update file that only a relay would have released
        answered = list(handoff.scratch_dir().glob(f"sovfl-s-update-{os.getpid()}-*"))
        assert len(answered) == 1
        handoff.release(str(answered[0]))
        with pytest.raises(SessionError, match="an evaluation round must report loss"):
            sess.serve_one("Evaluate", request, lambda rnd: rnd.report(num_examples=3))
        reply = sess.serve_one("Evaluate", request, lambda rnd: rnd.report(num_examples=3, loss=0.5, accuracy=1.0))
        assert reply["metrics"] == {"eval_loss": 0.5, "eval_accuracy": 1.0, "num_val_examples": 3,
                                    "load_s": reply["metrics"]["load_s"]}
        reply = sess.serve_one("Train", request, lambda rnd: rnd.report(num_examples=7, loss=2.0, steps=3))
        assert reply["ok"] and reply["num_examples"] == 7 and reply["metrics"]["steps"] == 3
        assert set(reply["metrics"]) >= {"loss", "train_s", "load_s", "pack_s"}
        handoff.release(reply["update"]["path"])
    finally:
        handoff.release(h.path)


def test_round_left_without_report_is_answered_then_raises(group, tmp_path):
    """Through the endpoint: the relay gets an error naming the round at once (it does not wait
    for its deadline), and the loop raises SessionError instead of taking the next round."""
    import threading
    import time
    from pathlib import Path

    from site_trainer import endpoint
    from site_trainer.session import SessionError

    cfg = _cfg(tmp_path)
    sess = Session(_site_model(cfg), cfg)
    h = handoff.write_arrays(workloads.initial_weights(cfg.workload, 0), "noreport")
    answers: list[str] = []

    def relay() -> None:
        end = time.monotonic() + 60
        while not Path(cfg.socket + ".ready").exists() and time.monotonic() < end:
            time.sleep(0.05)
        try:
            endpoint.call(cfg.socket, "Train", {"round": 4, "global": h.to_json(), "timeout_s": 60}, timeout_s=60)
        except endpoint.TrainerError as err:
            answers.append(str(err))

    thread = threading.Thread(target=relay)
    thread.start()
    try:
        with pytest.raises(SessionError, match=r"round 4 \(train\) ended without rnd.report"):
            for _ in sess.rounds():
                pass  # forgets rnd.report(...)
        thread.join(60)
    finally:
        handoff.release(h.path)
    assert answers == ["site s: round 4 ended without report(); the training loop must call rnd.report(...) on "
                       "every rank"]
    assert not Path(cfg.socket).exists()  # the endpoint closed with the loop
