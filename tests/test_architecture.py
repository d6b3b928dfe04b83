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


# ---- private attributes of torch / TorchRec / fbgemm: adapters/torchrec_compat.py only ----
COMPAT = ROOT / "adapters" / "torchrec_compat.py"
# deck's own private names read across its modules, each with its reason.
OWN_PRIVATE = {
    "_sharded_modules": "adapters/dmp.py reads the TorchRec adapter's sharded modules (issue 23 item 3)",
}


def _compat_names() -> set[str]:
    """PRIVATE_ATTRIBUTES of the compatibility module, read from its source (no torch import)."""
    for node in ast.parse(COMPAT.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and getattr(node.targets[0], "id", "") == "PRIVATE_ATTRIBUTES"
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError("adapters/torchrec_compat.py defines no PRIVATE_ATTRIBUTES")


def _attribute_uses(tree: ast.AST) -> list[tuple[int, str, ast.expr]]:
    """(line, name, owner) of every ``owner.name`` and ``getattr/hasattr/setattr(owner, "name")``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr, node.value))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            out.append((node.lineno, node.args[1].value, node.args[0]))
    return out


def _foreign_private_uses(source: str, compat_names: set[str], scan_private: bool) -> list[str]:
    """Uses of the compat module's names, and (``scan_private``) of any ``_name`` on an object
    that is not ``self``/``cls``, outside deck's own allowlist."""
    bad = []
    for line, name, owner in _attribute_uses(ast.parse(source)):
        if getattr(owner, "id", None) in ("self", "cls"):  # a class's own attributes
            continue
        if name in compat_names:
            bad.append(f"{line}: {name}")
        elif scan_private and name.startswith("_") and not name.startswith("__"):
            bad += [] if name in OWN_PRIVATE else [f"{line}: {name} on {ast.unparse(owner)}"]
    return bad


def test_scanner_finds_private_attribute_uses() -> None:
    names = {"_lookups", "iter_cpu"}
    src = (
        "m._lookups\ngetattr(t, 'iter_cpu')\nself._x\nw._step\nobj.__class__\nr._sharded_modules()"
    )
    assert _foreign_private_uses(src, names, scan_private=False) == ["1: _lookups", "2: iter_cpu"]
    assert _foreign_private_uses(src, names, scan_private=True) == [
        "1: _lookups",
        "2: iter_cpu",
        "4: _step on w",
    ]


def test_torch_private_attributes_only_in_the_compat_module() -> None:
    names = _compat_names()
    bad = []
    for mod, path in sorted(MODULES.items()):
        if path == COMPAT:
            continue
        scan_private = path.is_relative_to(FOLDERS["deck.adapters"])
        bad += [f"{mod}:{u}" for u in _foreign_private_uses(path.read_text(), names, scan_private)]
    assert not bad, (
        "private attributes of torch/TorchRec/fbgemm are read through adapters/torchrec_compat.py "
        "only:\n" + "\n".join(bad)
    )


# ---- only the public API of torch.distributed.checkpoint ---------------------------------------

DCP = "torch.distributed.checkpoint"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_dcp_uses(path: Path) -> list[str]:
    """The private names of DCP that the file at ``path`` touches: a ``_`` module or name
    imported from it, a ``_`` attribute of a name bound to it, or, in a subclass of a DCP class,
    a ``self._x`` that the subclass does not define itself (DCP's internals, which change
    between releases)."""
    tree = ast.parse(path.read_text())
    bound: set[str] = set()
    out = []
    for node in ast.walk(tree):
        names: list[tuple[str, str]] = []  # (module or name, name bound)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(DCP):
            names = [(f"{node.module}.{a.name}", a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            names = [(a.name, a.asname or "") for a in node.names if a.name.startswith(DCP)]
        for full, local in names:
            if any(map(_private, full.split("."))):
                out.append(f"{path}:{node.lineno}: imports {full}")
            if local:
                bound.add(local)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = ast.unparse(node.value)
            if base in bound or base.startswith(DCP):
                out.append(f"{path}:{node.lineno}: uses {base}.{node.attr}")
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b) in bound for b in node.bases):
            attrs = [n for n in ast.walk(node) if isinstance(n, ast.Attribute)]
            own = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            own |= {n.attr for n in attrs if isinstance(n.ctx, ast.Store)}
            out += [
                f"{path}:{n.lineno}: {node.name} uses its DCP base's self.{n.attr}"
                for n in attrs
                if ast.unparse(n.value) == "self" and _private(n.attr) and n.attr not in own
            ]
    return out


def test_only_public_names_of_torch_distributed_checkpoint() -> None:
    bad = [msg for path in MODULES.values() for msg in _private_dcp_uses(path)]
    assert not bad, "private DCP names (implement its public StorageWriter instead):\n" + "\n".join(
        bad
    )


def test_the_dcp_scan_finds_private_names(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint import FileSystemWriter\n"
        "from torch.distributed.checkpoint.filesystem import _StorageInfo\n"
        "x = dcp._version\n"
        "class W(FileSystemWriter):\n"
        "    def write_data(self, plan, planner):\n"
        "        self._mine = 1\n"
        "        return self._write_data(planner, self._mine)\n"
    )
    found = sorted(msg.split(": ", 1)[1] for msg in _private_dcp_uses(src))
    assert found == [
        "W uses its DCP base's self._write_data",
        "imports torch.distributed.checkpoint.filesystem._StorageInfo",
        "uses dcp._version",
    ], found
