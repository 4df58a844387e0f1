"""crypto/durable.py: the one recipe every store uses for a write that a crash cannot tear."""

from __future__ import annotations

import os
import stat

import pytest

from crypto.durable import fsync_path, write_atomic, write_synced


def test_write_atomic_replaces_with_mode_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "state.json"
    write_atomic(target, "old", 0o600)
    assert target.read_text() == "old" and stat.S_IMODE(target.stat().st_mode) == 0o600
    write_atomic(target, b"new", 0o644)
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.json"]


def test_a_failed_write_keeps_the_old_content_and_cleans_up(tmp_path):
    target = tmp_path / "model.bin"
    write_atomic(target, b"good")
    with pytest.raises(TypeError):
        write_atomic(target, 12345)  # not bytes: fails after the temporary file exists
    assert target.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]


def test_write_synced_and_fsync_of_files_and_directories(tmp_path):
    path = tmp_path / "part"
    write_synced(path, b"\x00" * 10)
    assert path.read_bytes() == b"\x00" * 10
    fsync_path(path)
    fsync_path(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_path(tmp_path / "missing")
    assert os.path.isdir(tmp_path)
