"""Unit tests of the pure pieces: aggregation, update checks, hand-off, endpoint, layering."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from federation.coordinator.aggregate import ServerOptimizer, WeightedMean
from federation.coordinator.checkpoint import load_checkpoint, save_checkpoint
from federation.protocol.pipeline import UpdateRejected, check_update
from site_trainer import endpoint, handoff


def test_weighted_mean_is_sample_weighted():
    rng = np.random.default_rng(0)
    ups = [{"w": rng.normal(size=(3, 4)).astype(np.float32)} for _ in range(3)]
    ns = [10, 30, 60]
    m = WeightedMean()
    for u, n in zip(ups, ns):
        m.add(u, n)
    want = sum(u["w"].astype(np.float64) * n for u, n in zip(ups, ns)) / sum(ns)
    np.testing.assert_allclose(m.result()["w"], want, rtol=0, atol=1e-7)
    with pytest.raises(ValueError):
        m.add(ups[0], 0)
    with pytest.raises(ValueError, match="no update"):
        WeightedMean().result()


def test_weighted_mean_in_slices_is_the_float64_formula_bit_for_bit(monkeypatch):
    """Folding slice by slice (bounded temporaries) computes exactly Σ f64(u)·n / Σ n, rounded to
    float32 once, for tensors many slices long and one shorter than a slice; the sum is consumed."""
    import federation.coordinator.aggregate as agg

    monkeypatch.setattr(agg, "SLICE", 1000)
    rng = np.random.default_rng(1)
    ups = [{"big": rng.normal(size=(37, 101)).astype(np.float32), "small": rng.normal(size=7).astype(np.float32)}
           for _ in range(3)]
    ns = [3, 11, 5]
    m = agg.WeightedMean()
    for u, n in zip(ups, ns):
        m.add(u, n)
    got = m.result()
    for k in ("big", "small"):
        want = (sum(u[k].astype(np.float64) * n for u, n in zip(ups, ns)) / sum(ns)).astype(np.float32)
        assert got[k].dtype == np.float32 and np.array_equal(got[k], want)
    with pytest.raises(ValueError, match="no update"):
        m.result()


def test_fedavg_step_consuming_the_mean_equals_the_plain_step():
    rng = np.random.default_rng(2)
    model = {k: rng.normal(size=50).astype(np.float32) for k in "ab"}
    mean = {k: rng.normal(size=50).astype(np.float32) for k in "ab"}
    for kind, lr in (("delta", 0.7), ("weights", 1.0), ("weights", 0.5)):
        want = ServerOptimizer("fedavg", kind, lr=lr).step(model, dict(mean))
        eaten = dict(mean)
        got = ServerOptimizer("fedavg", kind, lr=lr).step(model, eaten, consume=True)
        assert eaten == {} and all(np.array_equal(got[k], want[k]) for k in model)


def test_fedavg_weights_and_delta():
    model = {"w": np.ones(4, np.float32)}
    assert np.array_equal(ServerOptimizer("fedavg", "weights").step(model, {"w": np.full(4, 3, np.float32)})["w"], np.full(4, 3))
    out = ServerOptimizer("fedavg", "delta", lr=0.5).step(model, {"w": np.full(4, 2, np.float32)})
    np.testing.assert_allclose(out["w"], 2.0)


@pytest.mark.parametrize("strategy", ["fedadam", "fedyogi"])
def test_adaptive_server_optimizers(strategy):
    opt = ServerOptimizer(strategy, "delta", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    model = {"w": np.zeros(2, np.float32)}
    d = np.array([1.0, -2.0], np.float32)
    out = opt.step(model, {"w": d})
    m = 0.1 * d
    v = np.full(2, 1e-6, np.float32)
    v = 0.99 * v + 0.01 * d * d if strategy == "fedadam" else v - 0.01 * d * d * np.sign(v - d * d)
    np.testing.assert_allclose(out["w"], 0.1 * m / (np.sqrt(v) + 1e-3), rtol=1e-5)
    assert np.sign(out["w"]).tolist() == [1.0, -1.0]
    state = opt.state()
    fresh = ServerOptimizer(strategy, "delta", lr=0.1)
    fresh.load_state(state)
    np.testing.assert_array_equal(fresh.m["w"], opt.m["w"])


@pytest.mark.parametrize("arrays,reason", [
    ({"w": np.zeros((2, 2), np.float32)}, "wrong_tensors"),
    ({"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float64)}, "wrong_dtype"),
    ({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}, "wrong_shape"),
    ({"w": np.array([[0, np.nan], [0, 0]], np.float32), "b": np.zeros(3, np.float32)}, "non_finite"),
    ({"w": np.array([[0, np.inf], [0, 0]], np.float32), "b": np.zeros(3, np.float32)}, "non_finite"),
])
def test_bad_updates_rejected(arrays, reason):
    spec = {"w": ("<f4", (2, 2)), "b": ("<f4", (3,))}
    with pytest.raises(UpdateRejected) as err:
        check_update(arrays, spec)
    assert err.value.reason == reason
    check_update({"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32)}, spec)


def test_handoff_roundtrip_without_pickle(tmp_path):
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int64), "e": np.zeros(0, np.float32)}
    h = handoff.write_arrays(arrays, "t", tmp_path)
    back = handoff.map_arrays(handoff.Handle.from_json(h.to_json()))
    for k in arrays:
        np.testing.assert_array_equal(back[k], arrays[k])
        assert back[k].dtype == arrays[k].dtype
    handoff.release(h.path)
    handoff.release(h.path)  # idempotent
    with pytest.raises(ValueError, match="malformed"):
        handoff.Handle.from_json({"path": "x"})


def test_handoff_reader_copies_one_array_at_a_time_and_outlives_the_file(tmp_path):
    """What trainer rank 0 uses: pread into fresh arrays, no mapping; readable after the unlink."""
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "s": np.array(2.5, np.float32),
              "e": np.zeros((2, 0), np.float32)}
    h = handoff.write_arrays(arrays, "t", tmp_path)
    with handoff.Reader(h) as reader:
        handoff.release(h.path)
        assert list(reader) == list(arrays) and len(reader) == 3
        for k, v in arrays.items():
            got = reader[k]
            np.testing.assert_array_equal(got, v)
            assert got.shape == v.shape and got.flags.writeable
            got[...] = 0  # a copy: the file is untouched
        np.testing.assert_array_equal(reader["a"], arrays["a"])


def test_handoff_sweep_removes_only_files_of_dead_writers_of_its_tag(tmp_path):
    """A rank killed while it wrote its update leaves its hand-off file behind (in /dev/shm: memory);
    the next trainer of that site removes it, and nothing of a live process or of another tag."""
    code = ("import sys; from site_trainer import handoff; "
            "print(handoff.Writer({'w': ('<f4', (4,))}, sys.argv[1], sys.argv[2]).handle.path)")
    dead = subprocess.run([sys.executable, "-c", code, "s-update", str(tmp_path)], capture_output=True, text=True,
                          check=True).stdout.strip()  # the process has exited, its file is still there
    other_tag = subprocess.run([sys.executable, "-c", code, "s2-update", str(tmp_path)], capture_output=True,
                               text=True, check=True).stdout.strip()
    with handoff.Writer({"w": ("<f4", (4,))}, "s-update", tmp_path) as mine:  # this (live) process's
        pass
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as sleeper:
        try:
            live = tmp_path / f"sovfl-s-update-{sleeper.pid}-0123456789ab"
            live.write_bytes(b"x")
            stray = tmp_path / "sovfl-s-update-notes.txt"  # not a hand-off file's name
            stray.write_bytes(b"x")
            assert handoff.sweep_stale("s-update", tmp_path) == [dead]
            assert live.exists() and stray.exists() and Path(other_tag).exists() and Path(mine.handle.path).exists()
            assert not Path(dead).exists()
        finally:
            sleeper.kill()


def test_handoff_writer_refuses_a_tensor_of_another_layout(tmp_path):
    with handoff.Writer({"w": ("<f4", (2, 2))}, "t", tmp_path) as writer:
        with pytest.raises(ValueError, match=r"hand-off entry w: got <f8\(2, 2\), layout says <f4\(2, 2\)"):
            writer.write("w", np.zeros((2, 2)))
        writer.write("w", np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(handoff.map_arrays(writer.handle)["w"], np.ones((2, 2)))
    handoff.release(writer.handle.path)


def test_handoff_rejects_short_file(tmp_path):
    h = handoff.write_arrays({"a": np.ones(100, np.float32)}, "t", tmp_path)
    with open(h.path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="needs"):
        handoff.map_arrays(h)
    with pytest.raises(ValueError, match="needs"):
        handoff.Reader(h)


def test_endpoint_unavailable_and_long_socket(tmp_path):
    with pytest.raises(endpoint.TrainerUnavailable, match="unreachable.*no socket there"):
        endpoint.call(str(tmp_path / "none.sock"), "Info", {}, timeout_s=2)
    with pytest.raises(ValueError, match="Unix socket limit"):
        endpoint.check_socket_path("/tmp/" + "x" * 200)


def test_endpoint_tells_an_exited_trainer_from_a_stopped_one(tmp_path):
    """A socket file nobody listens on (the trainer died) and one whose listener never answers
    (SIGSTOPped: the kernel still queues connections) fail differently and say so."""
    dead, stopped = str(tmp_path / "dead.sock"), str(tmp_path / "stopped.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(dead)  # bound, never listening: what a killed trainer leaves behind
    with pytest.raises(endpoint.TrainerUnavailable, match="nothing accepts connections there"):
        endpoint.call(dead, "Info", {}, timeout_s=2)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(stopped)
        s.listen(8)  # connections queue, nothing reads them
        assert "accepted the connection but did not answer" in endpoint._diagnose(stopped)
        with pytest.raises(endpoint.TrainerUnavailable, match="did not answer Info within 1s"):
            endpoint.call(stopped, "Info", {}, timeout_s=1)


def test_endpoint_roundtrip_and_errors(tmp_path):
    sock = str(tmp_path / "t.sock")

    def handler(method, req):
        return {"ok": req.get("x", 0) > 0, "echo": req.get("x"), "error": "x must be positive"}

    server = endpoint.serve(sock, handler)
    try:
        assert endpoint.call(sock, "Info", {"x": 3}, timeout_s=5)["echo"] == 3
        with pytest.raises(endpoint.TrainerError, match="positive"):
            endpoint.call(sock, "Train", {"x": -1}, timeout_s=5)
    finally:
        server.stop(0)


def test_checkpoint_roundtrip(tmp_path):
    model = {"w": np.arange(4, dtype=np.float32)}
    save_checkpoint(tmp_path, 1, model, {"m/w": np.ones(4, np.float32)})
    path = save_checkpoint(tmp_path, 2, {"w": model["w"] * 2}, {})
    rnd, m, opt = load_checkpoint(tmp_path)  # the newest
    assert rnd == 2 and path.name == "round_0002" and opt == {}
    np.testing.assert_array_equal(m["w"], model["w"] * 2)


def test_clientapp_import_path_is_free_of_torch():
    code = "import sys, federation.site.client_app; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
