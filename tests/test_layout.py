"""The layering of the tree, checked from the source: who may import whom, and docstrings.

federation/ is grouped by where code runs (federation/README.md): the site's side never imports the
coordinator's and the reverse; the protocol both share imports neither; the config schema imports
neither; only ops/ (CLI, launcher, the in-process federation) joins them. Below federation/, crypto/
imports neither torch nor flwr, site_trainer/ never imports flwr or federation, and the ClientApp's
import path (everything federation/site/client_app.py reaches) stays free of torch: Flower starts one
ClientApp process per message. Imports are read with `ast`, lazy ones inside functions included, so
a rule cannot be dodged by importing late. No two of our modules import each other, directly or
through others (an import cycle), and the coordinator's parts never import its driver: they are
handed what they need.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (modules the rule applies to, imports they must not make, why)
RULES = [
    ("federation.site", ("federation.coordinator", "federation.ops"), "the site never imports the coordinator's side"),
    ("federation.coordinator", ("federation.site", "federation.ops"), "the coordinator never imports the site's side"),
    ("federation.protocol", ("federation.site", "federation.coordinator", "federation.ops", "federation.config"),
     "the protocol is what both sides share: it imports neither"),
    ("federation.config", ("federation.site", "federation.coordinator", "federation.ops"),
     "the config schema is read by every side and imports none"),
    ("federation.protocol.codecs", ("torch", "flwr", "federation.protocol.pipeline"),
     "the codec library is numpy + pydantic only"),
    ("crypto", ("torch", "flwr", "federation", "site_trainer"), "crypto/ is numpy + cryptography only"),
    ("site_trainer", ("flwr", "federation"), "site_trainer/ knows nothing of Flower or the federation"),
    ("tracking", ("torch", "flwr", "federation", "site_trainer"),
     "tracking/ is pydantic + the trackers' own libraries, which every side may use"),
]
CLIENT_APP = "federation.site.client_app"
# never on the ClientApp's import path (one process per message): torch, and the trackers' libraries
CLIENT_APP_FORBIDDEN = ("torch", "tensorboard", "mlflow", "wandb")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file, relative imports resolved."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return out


def source_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for the packages the rules speak of."""
    return {module_name(p, root): p for top in ("federation", "crypto", "site_trainer", "tracking")
            for p in sorted((root / top).rglob("*.py"))}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: Path) -> list[str]:
    """One line per forbidden import under `root`, naming the file, the import and the rule."""
    modules = source_modules(root)
    found = []
    for name, path in modules.items():
        imported = imports_of(path, root)
        for scope, forbidden, why in RULES:
            if not _within(name, scope):
                continue
            bad = {imp for imp in imported if any(_within(imp, f) for f in forbidden)}
            for imp in sorted(bad):
                if imp.rpartition(".")[0] not in bad:  # `from a.b import c`: report a.b, not a.b.c again
                    found.append(f"{path.relative_to(root)}: imports {imp} ({why})")
    # the ClientApp's import path: every in-tree module it reaches, transitively
    seen, todo = set(), [CLIENT_APP]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        for imp in imports_of(modules[name], root):
            heavy = next((f for f in CLIENT_APP_FORBIDDEN if _within(imp, f)), None)
            if heavy is not None:
                found.append(f"{modules[name].relative_to(root)}: imports {imp} (the ClientApp's import path "
                             f"stays free of {heavy}; reached from {CLIENT_APP})")
            todo.extend(p for p in _parents(imp) if p in modules)  # a.b.c runs a, a.b and a.b.c
    return sorted(set(found))


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def test_no_forbidden_import_anywhere():
    found = violations(ROOT)
    assert not found, f"{len(found)} forbidden import(s):\n" + "\n".join(found)


def write_tree(root: Path, files: dict[str, str]) -> None:
    """A source tree under `root`: relative path -> text."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checker_catches_each_kind_of_forbidden_import(tmp_path):
    """A tree with one violation of each rule: every one is reported (the check cannot pass vacuously)."""
    files = {
        "federation/__init__.py": "",
        "federation/site/__init__.py": "",
        "federation/site/client_app.py": "from federation.site import helper, uses_tracking\n",
        "federation/site/helper.py": "def f():\n    import torch.nn\n",
        "federation/site/bad.py": "from federation.coordinator.driver import Coordinator\n",
        "federation/coordinator/__init__.py": "",
        "federation/coordinator/bad.py": "from ..site import client_app\n",
        "federation/protocol/__init__.py": "",
        "federation/protocol/bad.py": "import federation.config\n",
        "federation/config/__init__.py": "from federation.ops import cli\n",
        "federation/ops/__init__.py": "",
        "crypto/__init__.py": "import flwr\n",
        "site_trainer/__init__.py": "from flwr.app import Message\n",
        "federation/site/uses_tracking.py": "def f():\n    import mlflow\n",
        "tracking/__init__.py": "from site_trainer import x\n",
    }
    write_tree(tmp_path, files)
    found = "\n".join(violations(tmp_path))
    for needle in ("federation/site/bad.py: imports federation.coordinator.driver",
                   "federation/coordinator/bad.py: imports federation.site",
                   "federation/protocol/bad.py: imports federation.config",
                   "federation/config/__init__.py: imports federation.ops",
                   "crypto/__init__.py: imports flwr",
                   "site_trainer/__init__.py: imports flwr.app",
                   "tracking/__init__.py: imports site_trainer",
                   "federation/site/uses_tracking.py: imports mlflow (the ClientApp's import path",
                   "federation/site/helper.py: imports torch.nn (the ClientApp's import path"):
        assert needle in found, found


def module_imports(path: Path, root: Path, modules: dict[str, Path]) -> set[str]:
    """The in-tree modules `path` imports (`from pkg import mod` is pkg.mod when that is a module)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.update([full] if full in modules else [base] if base in modules else [])
    out.discard(name)
    return out


def import_cycles(root: Path) -> list[list[str]]:
    """Every group of modules that import one another, directly or through others (Tarjan's
    strongly connected components of the import graph, of more than one module)."""
    modules = source_modules(root)
    graph = {name: module_imports(path, root, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def test_no_import_cycle():
    cycles = import_cycles(ROOT)
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_catches_an_import_cycle(tmp_path):
    files = {
        "federation/__init__.py": "",
        "federation/a.py": "from federation import b\n",
        "federation/b.py": "def f():\n    from .c import g\n",
        "federation/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from federation.a import x\n",
        "federation/d.py": "from federation import a\n",
    }
    write_tree(tmp_path, files)
    assert import_cycles(tmp_path) == [["federation.a", "federation.b", "federation.c"]]


def test_the_coordinators_parts_never_import_the_driver():
    """The driver holds the parts (roster, exchange, run state, hooks, strategies); only the
    ServerApp, which starts it, imports it."""
    modules = source_modules(ROOT)
    driver = "federation.coordinator.driver"
    found = [name for name, path in modules.items() if _within(name, "federation.coordinator")
             and name not in (driver, "federation.coordinator.server_app")
             and driver in module_imports(path, ROOT, modules)]
    assert not found, f"import the driver: {found}"


def test_client_app_import_loads_no_torch():
    """The same property at run time, as a fresh ClientApp process sees it."""
    code = f"import sys, {CLIENT_APP}; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def missing_docstrings(root: Path) -> list[str]:
    """Public modules, classes and functions (methods included) of federation/ without a docstring."""
    out = []
    for path in sorted((root / "federation").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        rel = path.relative_to(root)
        if not ast.get_docstring(tree):
            out.append(f"{rel}: module")

        def visit(body, owner: str) -> None:
            for node in body:
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.name.startswith("_"):
                        continue
                    if not ast.get_docstring(node):
                        out.append(f"{rel}:{node.lineno}: {owner}{node.name}")
                    if isinstance(node, ast.ClassDef):
                        visit(node.body, f"{node.name}.")

        visit(tree.body, "")
    return out


def test_every_public_definition_of_federation_says_why():
    missing = missing_docstrings(ROOT)
    assert missing == [], f"{len(missing)} without a docstring:\n" + "\n".join(missing)
