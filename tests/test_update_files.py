"""The trainer's long-lived update files (site_trainer/update_files.py): a file still read is never
written (the shared lock of an open Reader keeps the next rounds off it: they take the other file,
or a one-off file), a handle whose file was taken again fails instead of reading another round's
bytes, layouts may change size between rounds, and the files go with the trainer (its close, its
exit, or, after a kill, the next trainer's sweep). Real files in /dev/shm, a real gloo group of
one rank for the session's rounds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from site_trainer import handoff, layout, transfer, update_files
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.session import Session

ROOT = Path(__file__).resolve().parent.parent


def _spec(n: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {"a": ("<f4", (n,)), "b": ("<u2", (3,))}


def _write(writer, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {"a": rng.normal(size=n).astype(np.float32), "b": rng.integers(0, 9, 3).astype(np.uint16)}
    for k, v in arrays.items():
        writer.write(k, v)
    writer.close()
    return arrays


def _read(handle: handoff.Handle) -> dict[str, np.ndarray]:
    with handoff.Reader(handle) as r:
        return {k: r[k] for k in r}


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_a_file_still_read_is_never_written_and_a_reused_handle_fails(tmp_path):
    files = update_files.UpdateFiles("test-uf-reuse", directory=tmp_path)
    try:
        w1 = files.writer(_spec(5000))
        one = _write(w1, 5000, 1)
        h1 = w1.handle
        assert h1.owned and handoff.Handle.from_json(h1.to_json()) == h1
        r1 = handoff.Reader(h1)  # round 1's reader (the ClientApp still uploading it)
        w2 = files.writer(_spec(5000))  # round 2: the other file
        assert w2.handle.path != h1.path
        two = _write(w2, 5000, 2)
        r2 = handoff.Reader(w2.handle)
        assert files.writer(_spec(5000)) is None  # both read: the caller writes a one-off file
        _same({k: r1[k] for k in r1}, one)  # neither was touched
        _same({k: r2[k] for k in r2}, two)
        r1.close()
        w3 = files.writer(_spec(5000))  # round 3 takes round 1's file, now that nobody reads it
        assert w3.handle.path == h1.path and w3.generation > w2.generation
        with pytest.raises(ValueError, match="being rewritten"):
            handoff.Reader(w3.handle)  # locked while the round writes it
        three = _write(w3, 5000, 3)
        with pytest.raises(ValueError, match=r"holds generation \d+, not 1: its writer reused it"):
            handoff.Reader(h1)  # a stale handle of round 1 never reads round 3's bytes
        _same(_read(w3.handle), three)
        r2.close()
        assert len(files.files) == 2
    finally:
        files.close()
    assert not list(tmp_path.iterdir())


def test_layouts_may_grow_and_shrink_between_rounds(tmp_path):
    files = update_files.UpdateFiles("test-uf-size", directory=tmp_path, slots=1)
    try:
        for n, seed in [(10, 1), (300_000, 2), (7, 3), (400_000, 4)]:
            w = files.writer(_spec(n))
            arrays = _write(w, n, seed)
            assert os.path.getsize(w.handle.path) >= w.size
            _same(_read(w.handle), arrays)
        assert len(files.files) == 1  # one file throughout, grown where needed
    finally:
        files.close()


def test_an_abandoned_round_leaves_the_file_unstamped_and_free(tmp_path):
    files = update_files.UpdateFiles("test-uf-abandon", directory=tmp_path, slots=1)
    try:
        w = files.writer(_spec(100))
        w.write("a", np.zeros(100, np.float32))
        w.abandon()
        with pytest.raises(ValueError, match="holds generation 0"):
            handoff.Reader(w.handle)
        w2 = files.writer(_spec(100))  # the lock was given back
        assert w2 is not None and w2.handle.path == w.handle.path
        arrays = _write(w2, 100, 5)
        _same(_read(w2.handle), arrays)
    finally:
        files.close()


def test_a_file_someone_unlinked_is_replaced(tmp_path):
    files = update_files.UpdateFiles("test-uf-unlinked", directory=tmp_path)
    try:
        w = files.writer(_spec(64))
        _write(w, 64, 1)
        handoff.release(w.handle.path)  # a reader that took it for a one-off file
        w2 = files.writer(_spec(64))
        assert w2.handle.path != w.handle.path and Path(w2.handle.path).exists()
        arrays = _write(w2, 64, 2)
        _same(_read(w2.handle), arrays)
        assert len(files.files) == 1
    finally:
        files.close()


_CHILD = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {root!r})
    from site_trainer import update_files
    files = update_files.UpdateFiles({tag!r})
    w = files.writer({{"a": ("<f4", (1000,))}})
    w.write("a", np.ones(1000, np.float32))
    w.close()
    print(w.handle.path, flush=True)
    if {hang}:
        sys.stdin.read()  # killed here
""")


def _child(tag: str, hang: bool) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=str(ROOT), tag=tag, hang=hang)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, Path(proc.stdout.readline().strip())


def test_files_go_at_exit_and_a_killed_trainers_are_swept():
    proc, path = _child("test-uf-exit", hang=False)
    assert proc.wait(timeout=60) == 0
    assert path.name.startswith(f"sovfl-test-uf-exit-{proc.pid}-") and not path.exists()  # unlinked at exit
    proc, path = _child("test-uf-kill", hang=True)
    try:
        assert path.exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert path.exists()  # nothing ran at the kill
        assert handoff.sweep_stale("test-uf-kill") == [str(path)]  # what the next trainer does at its start
        assert not path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- through the session's rounds ----------------------------------------------------------------
class Bf16(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3 * transfer.PIECE_BYTES // 4 + 11, dtype=torch.bfloat16))
        self.b = nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))


def _words(rng, shape) -> np.ndarray:
    return np.asarray(rng.integers(0, 2**16, size=shape, dtype=np.uint16) & np.uint16(0xBFFF))


def _session(tmp_path, site: str, seed: int) -> tuple[Bf16, Session, dict[str, np.ndarray], handoff.Handle]:
    """A one-rank session of a Bf16 model, and a random global model of it in a hand-off file."""
    model = Bf16()
    cfg = TrainerConfig(site=SiteConfig(id=site, partition=0), workload=WorkloadConfig(task="slm"),
                        num_partitions=1, socket=str(tmp_path / "s.sock"), workdir=str(tmp_path))
    rng = np.random.default_rng(seed)
    glob = {k: _words(rng, t.shape) for k, t in layout.named_tensors(model).items()}
    return model, Session(model, cfg), glob, handoff.write_arrays(glob, f"{site}-global")


def test_rounds_never_overwrite_an_update_still_being_read(single_rank_group, tmp_path):
    """Round 1's update is still open (a ClientApp uploading it) while rounds 2 and 3 are packed:
    round 2 goes to the other file, round 3 (both held) to a one-off file; every reader reads its
    own round's bytes. Once released, round 4 takes a trainer's file again. At the end the session
    closes its files."""
    model, sess, glob, gh = _session(tmp_path, "uf", 0)
    rng = np.random.default_rng(1)
    readers, want = [], []

    def train(round_no: int, kind: str) -> handoff.Handle:
        new = {k: _words(rng, v.shape) for k, v in glob.items()}

        def body(rnd):
            with torch.no_grad():
                for k, t in layout.named_tensors(model).items():
                    t.copy_(torch.from_numpy(new[k]).view(torch.bfloat16))
            rnd.report(num_examples=1)

        reply = sess.serve_one("Train", {"round": round_no, "global": gh.to_json(), "config": {"update_kind": kind}},
                               body)
        assert reply["ok"], reply
        want.append(new if kind == "weights" else {
            k: (torch.from_numpy(new[k]).view(torch.bfloat16).float()
                - torch.from_numpy(glob[k]).view(torch.bfloat16).float()).to(torch.bfloat16).view(torch.uint16).numpy()
            for k in new})
        handle = handoff.Handle.from_json(reply["update"])
        readers.append(handoff.Reader(handle))
        return handle

    try:
        h1 = train(1, "delta")
        h2 = train(2, "weights")
        h3 = train(3, "delta")
        assert h1.owned and h2.owned and h1.path != h2.path
        assert not h3.owned and h3.path not in (h1.path, h2.path)  # both still read: a one-off file
        handoff.release(h3.path)  # as the ClientApp does with a one-off file
        for r, w in zip(readers, want):
            _same({k: r[k] for k in r}, w)
        for r in readers:
            r.close()
        h4 = train(4, "delta")
        assert h4.owned and h4.path in (h1.path, h2.path)
        _same({k: readers[-1][k] for k in readers[-1]}, want[-1])
        readers[-1].close()
    finally:
        for r in readers:
            r.close()
        handoff.release(gh.path)
        sess.close_files()
    assert not Path(h1.path).exists() and not Path(h2.path).exists()


def test_a_nan_in_a_later_piece_of_the_model_is_refused(single_rank_group, tmp_path):
    model = Bf16()
    cfg = TrainerConfig(site=SiteConfig(id="ufnan", partition=0), workload=WorkloadConfig(task="slm"),
                        num_partitions=1, socket=str(tmp_path / "s.sock"), workdir=str(tmp_path))
    sess = Session(model, cfg)
    glob = {k: np.zeros(tuple(t.shape), np.uint16) for k, t in layout.named_tensors(model).items()}
    glob["w"][transfer.PIECE_BYTES // 2 + 5] = 0x7FC0  # a bf16 NaN in the tensor's second piece
    gh = handoff.write_arrays(glob, "ufnan-global")
    try:
        with handoff.Reader(gh) as reader:
            assert sess.load(reader) == {"w": "contains NaN or Inf"}
    finally:
        handoff.release(gh.path)
        sess.close_files()


def test_a_pack_that_fails_midway_leaves_the_file_for_the_next_round(single_rank_group, tmp_path, monkeypatch):
    """A piece that cannot be packed fails the round; the update file is left unstamped (a handle
    to it would fail) and unlocked, and the next round writes its update there, bit for bit."""
    from site_trainer import update_pack

    _, sess, glob, gh = _session(tmp_path, "uffail", 3)
    real = update_pack.UpdatePacker.weights_piece

    def broken(self, name, flat, lo, hi):
        if lo > 0:
            raise OSError("no space left (test)")
        real(self, name, flat, lo, hi)

    def body(rnd):
        rnd.report(num_examples=1)

    request = {"global": gh.to_json(), "config": {"update_kind": "weights"}}
    try:
        monkeypatch.setattr(update_pack.UpdatePacker, "weights_piece", broken)
        with pytest.raises(OSError, match="no space left"):
            sess.serve_one("Train", {"round": 1, **request}, body)
        (owned,) = sess.update_files.files
        with pytest.raises(ValueError, match="holds generation 0"):
            handoff.Reader(handoff.Handle(owned.path, (), sess.update_files.generation))  # left unstamped
        assert owned.take()  # nobody holds it
        owned.give_back()
        monkeypatch.setattr(update_pack.UpdatePacker, "weights_piece", real)
        reply = sess.serve_one("Train", {"round": 2, **request}, body)
        assert reply["ok"] and reply["update"]["path"] == owned.path
        _same(_read(handoff.Handle.from_json(reply["update"])), glob)  # the weights: the global just loaded
    finally:
        handoff.release(gh.path)
        sess.close_files()


def test_a_file_taken_by_an_unfinished_round_is_not_taken_again(tmp_path):
    files = update_files.UpdateFiles("test-uf-twice", directory=tmp_path)
    try:
        w1 = files.writer(_spec(10))  # never closed yet
        w2 = files.writer(_spec(10))
        assert w2.handle.path != w1.handle.path
        assert files.writer(_spec(10)) is None
        w1.close()
        assert files.writer(_spec(10)).handle.path == w1.handle.path
    finally:
        files.close()
