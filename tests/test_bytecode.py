"""The launcher's bytecode step (federation/ops/bytecode.py): after it, a child process that may not
write bytecode (PYTHONDONTWRITEBYTECODE=1) loads our modules from the cached files instead of
compiling their source, and an edited module is compiled again, not served stale."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from federation.ops.bytecode import compile_packages


def loads_from_bytecode(root: Path, module: str) -> bool:
    """Whether a fresh interpreter that may not write bytecode loads `module` from a cached file."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-v", "-c", f"import {module}"], env=env, capture_output=True,
                         text=True, check=True, cwd=root).stderr
    name = module.rsplit(".", 1)[-1]
    return any(line.startswith("# code object from ") and f"{name}." in line and ".pyc" in line
               for line in out.splitlines())


def test_children_load_compiled_modules_and_an_edit_is_recompiled(tmp_path, monkeypatch):
    pkg = tmp_path / "sovfl_bc_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not loads_from_bytecode(tmp_path, "sovfl_bc_pkg.sub.mod")  # nothing cached: compiled from source

    assert compile_packages(("sovfl_bc_pkg",))
    assert loads_from_bytecode(tmp_path, "sovfl_bc_pkg.sub.mod")

    # an edit makes the cached file stale: the child compiles the source (the new value), and the next
    # launch writes the bytecode again
    mod = pkg / "sub" / "mod.py"
    mod.write_text("VALUE = 22\n")
    later = time.time() + 5
    os.utime(mod, (later, later))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path)}
    got = subprocess.run([sys.executable, "-c", "import sovfl_bc_pkg.sub.mod as m; print(m.VALUE)"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got == "22" and not loads_from_bytecode(tmp_path, "sovfl_bc_pkg.sub.mod")
    assert compile_packages(("sovfl_bc_pkg",))
    assert loads_from_bytecode(tmp_path, "sovfl_bc_pkg.sub.mod")


def test_a_module_that_does_not_compile_is_reported_not_raised(tmp_path, monkeypatch):
    pkg = tmp_path / "sovfl_bc_bad"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text("X = 1\n")
    (pkg / "broken.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert compile_packages(("sovfl_bc_bad",)) is False  # a launch goes on; the import will name the error
    assert loads_from_bytecode(tmp_path, "sovfl_bc_bad.good")
