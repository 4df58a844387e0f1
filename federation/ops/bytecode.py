"""Bytecode for the project's own packages, written before a federation's processes start.

Flower starts one `flwr-clientapp` process per message and each imports about 75 of our modules
(and every trainer rank and the ServerApp import more). Python loads cached bytecode
(`__pycache__/*.pyc`) when it is present and current; otherwise every process compiles those
modules again: about 65 ms of CPU per ClientApp process on these cores, every message
(benchmarks/clientapp_cost.py). pip compiles a regular install, but an editable (development)
install only gets bytecode when Python may write it, and PYTHONDONTWRITEBYTECODE, set in many CI
and container shells, forbids that, so nothing is ever cached. The launcher therefore compiles our
packages once before it starts children: only missing or stale files (the same source mtime and
size check Python makes when it loads them), silently, and never failing a launch: where the
package directory is read-only the children simply compile in memory.
"""

from __future__ import annotations

import compileall
import functools
import importlib.util
import os

PACKAGES = ("crypto", "federation", "site_trainer", "tracking")
OPT_OUT = "SOVFL_NO_PRECOMPILE"  # set to 1 to leave bytecode alone (e.g. a read-only image)


def compile_packages(names: tuple[str, ...]) -> bool:
    """Write the missing or stale bytecode of the packages `names` (as found on sys.path); True when
    every module compiled and was written."""
    ok = True
    for name in names:
        spec = importlib.util.find_spec(name)
        for directory in (spec.submodule_search_locations or []) if spec else []:
            try:
                ok = compileall.compile_dir(directory, quiet=2, workers=1) and ok
            except OSError:
                ok = False
    return ok


@functools.cache
def ensure_compiled() -> bool:
    """Our packages' bytecode, current (checked once per process; `SOVFL_NO_PRECOMPILE=1` skips it)."""
    return os.environ.get(OPT_OUT) != "1" and compile_packages(PACKAGES)
