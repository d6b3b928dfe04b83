"""The import rules of docs/architecture.md, checked on the source (module and function level).

Packages are layers by process role; a package imports only the packages listed for it, so a
merger worker or an offline tool never loads the training-process code, and there are no
import cycles between modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "deck": ROOT / "deck",
    "deck.kernels": ROOT / "kernels",
    "deck.adapters": ROOT / "adapters",
}

# What each package may import from deck (besides itself and the shared leaves below). The
# adapter interface (TableShard, ModelAdapter) is a leaf: restore, export and the trainer see
# tables only through it; the TorchRec adapters sit on top of the trainer.
LEAVES = {"deck.errors", "deck.failpoints", "deck.version", "deck.config", "deck.adapters.base"}
ALLOWED = {
    "deck.storage": set(),
    "deck.format": {"deck.storage"},
    "deck.read": {"deck.format", "deck.storage"},
    "deck.merge": {"deck.format", "deck.read", "deck.storage"},
    "deck.ops": {"deck.format", "deck.read", "deck.storage", "deck.merge"},
    "deck.trainer": {"deck.format", "deck.read", "deck.storage", "deck.kernels"},
    "deck.kernels": set(),
    "deck.adapters": {"deck.trainer", "deck.format", "deck.read", "deck.storage", "deck.kernels"},
}
# Allowed edges against the layers, each with its reason.
EXCEPTIONS = {
    ("deck.trainer.checkpointer", "deck.adapters.torchrec"): "the default adapter when none is "
    "given, imported on first use",
}


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in FOLDERS.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every deck module ``name`` imports, anywhere in the file (lazy imports count)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {  # imports under ``if TYPE_CHECKING:`` never run
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(module: str) -> str | None:
    return next((p for p in ALLOWED if module == p or module.startswith(p + ".")), None)


def test_packages_import_only_the_layers_below_them() -> None:
    bad = []
    for mod, deps in sorted(GRAPH.items()):
        pkg = _package(mod)
        if pkg is None:
            continue  # the top: deck/__init__, cli, demo, doctor, docgen, testing: anything
        for dep in sorted(deps):
            dep_pkg = _package(dep)
            if dep in LEAVES or dep_pkg == pkg or dep_pkg in ALLOWED[pkg]:
                continue
            if (mod, dep) in EXCEPTIONS:
                continue
            if dep == "deck":
                bad.append(f"{mod} imports the package root deck (import its modules instead)")
                continue
            bad.append(f"{mod} imports {dep}")
    assert not bad, "import rules of docs/architecture.md broken:\n" + "\n".join(bad)


def test_merge_and_ops_never_import_the_trainer() -> None:
    # The rule the layering exists for, stated on its own: merger workers and offline tools
    # run without the training-process code.
    for mod, deps in GRAPH.items():
        if _package(mod) in ("deck.merge", "deck.ops"):
            assert not {d for d in deps if d.startswith("deck.trainer")}, mod


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module", ["deck", "deck.ops.listing", "deck.read.lineage"])
def test_reading_tools_start_without_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'torchrec', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
