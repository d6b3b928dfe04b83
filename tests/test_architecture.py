"""The import rules of docs/architecture.md, checked on the source (module and function level).

Packages are layers by process role; a package imports only the packages listed for it, so a
merger worker or an offline tool never loads the training-process code, and there are no
import cycles between modules (inside a package, not even through imports for type checking
only). No module imports or reads a private (``_``) name of another deck module. Every module of
deck.kernels and every function of its C extension is used by the product, not only by tests.
The demo (the main job) and the test helpers (deck.testing) stand on top: nothing of deck
imports the demo but the test helpers, and no product module imports a test helper.
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
# adapter interface (deck.model: TableShard, ModelAdapter, the RowRecorder the tracking hooks
# write into) is a leaf: restore, export and the trainer see tables only through it. The model
# adapters (TorchRec's) implement it and import nothing else of deck; the trainer sits on top of
# them (TorchRec's adapter is its default, the model wrapper builds on adapters/dmp.py).
LEAVES = {
    "deck.errors",
    "deck.failpoints",
    "deck.version",
    "deck.config",
    "deck.schemes",
    "deck.model",
    "deck.at_exit",  # open checkpointers closed at interpreter exit (and by end_rank)
    "deck.units",  # sizes as log lines and the deck command print them
    "deck.stack",  # whether TorchRec's stack is installed, and what to install when not
    "deck.child_process",  # a child process ends with its parent (staging, merger workers)
}
ALLOWED = {
    "deck.storage": set(),
    "deck.format": {"deck.storage"},
    "deck.read": {"deck.format", "deck.storage"},
    "deck.merge": {"deck.format", "deck.read", "deck.storage"},
    "deck.ops": {"deck.format", "deck.read", "deck.storage", "deck.merge"},
    "deck.serve": {"deck.format", "deck.read", "deck.storage", "deck.merge", "deck.ops"},
    "deck.trainer": {"deck.format", "deck.read", "deck.storage", "deck.kernels", "deck.adapters"},
    "deck.kernels": set(),
    "deck.adapters": set(),
    # free_port, init_process_group, end_rank: the doctor's, the demo's and the harnesses' ranks
    "deck.processes": set(),
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


def _imports(name: str, path: Path, typing: bool = False) -> set[str]:
    """Every deck module ``name`` imports, anywhere in the file (lazy imports count); with
    ``typing``, those it imports under ``if TYPE_CHECKING:`` instead."""
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
        if (id(node) in typing_only) != typing:
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
TYPING = {name: _imports(name, path, typing=True) for name, path in MODULES.items()}


def _package(module: str) -> str | None:
    return next((p for p in ALLOWED if module == p or module.startswith(p + ".")), None)


def _home(module: str) -> str:
    """The package ``module`` belongs to for the cycle rule: its layer (``deck.trainer`` for
    ``deck.trainer.staging.part``), or outside the layers its own package."""
    if (layer := _package(module)) is not None:
        return layer
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


# Imports for type checking never run, so across packages they may point back (the lazy
# top-level names of ``deck``); inside a package they count: a cycle there is one knot.
CYCLE_GRAPH = {
    mod: deps | {d for d in TYPING[mod] if _home(d) == _home(mod)} for mod, deps in GRAPH.items()
}


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
            if dep == "deck":
                bad.append(f"{mod} imports the package root deck (import its modules instead)")
                continue
            bad.append(f"{mod} imports {dep}")
    assert not bad, "import rules of docs/architecture.md broken:\n" + "\n".join(bad)


def test_merge_and_ops_never_import_the_trainer() -> None:
    # The rule the layering exists for, stated on its own: merger workers and offline tools
    # run without the training-process code.
    for mod, deps in GRAPH.items():
        if _package(mod) in ("deck.merge", "deck.ops", "deck.serve"):
            assert not {d for d in deps if d.startswith("deck.trainer")}, mod


# ---- deck.kernels holds only what the product runs -------------------------------------------

KERNELS = "deck.kernels"
NATIVE_SOURCE = ROOT / "kernels" / "_native.c"


def _is_kernel(module: str) -> bool:
    return module.startswith(KERNELS + ".")


def _product_reach(graph: dict[str, set[str]]) -> set[str]:
    """The modules the product loads: everything imported, directly or through other modules,
    by a module of deck/ or adapters/ outside deck.kernels, except the test helpers
    (deck.testing); tests and benchmarks are not in ``graph`` at all."""
    roots = [
        m for m in graph if not _is_kernel(m) and m != KERNELS and not m.startswith("deck.testing")
    ]
    seen: set[str] = set()
    todo = [d for m in roots for d in graph[m]]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, set())
    return seen


def _dead_kernels(graph: dict[str, set[str]]) -> list[str]:
    reach = _product_reach(graph)
    return sorted(m for m in graph if _is_kernel(m) and m not in reach)


def test_every_kernel_module_is_used_by_the_product() -> None:
    dead = _dead_kernels(GRAPH)
    assert not dead, (
        "modules of deck.kernels that no product module (deck/, adapters/) reaches: only tests "
        f"or benchmarks call them; use them in the product or remove them: {dead}"
    )


def test_the_kernel_usage_scan_finds_a_dead_module() -> None:
    graph = {
        "deck.trainer.tracker": {"deck.kernels.claim"},
        "deck.kernels.claim": {"deck.kernels.native"},  # reached through claim
        "deck.kernels.native": set(),
        "deck.kernels.dead": {"deck.kernels.native"},  # imported by no one
        "deck.kernels.helper": set(),  # imported by dead only
        "deck.kernels.for_tests": set(),  # imported by a test helper only
        "deck.testing.synth": {"deck.kernels.for_tests"},
    }
    graph["deck.kernels.dead"].add("deck.kernels.helper")
    assert _dead_kernels(graph) == [
        "deck.kernels.dead",
        "deck.kernels.for_tests",
        "deck.kernels.helper",
    ]


def test_every_native_function_is_called_by_a_used_kernel_module() -> None:
    # The C extension's methods table: {"name", function, METH_VARARGS, ...}.
    table = NATIVE_SOURCE.read_text().split("PyMethodDef methods[]", 1)[1].split("};", 1)[0]
    names = {line.split('"')[1] for line in table.splitlines() if "METH_" in line}
    assert names, "no methods table found in kernels/_native.c"
    called = {
        n.attr
        for m in _product_reach(GRAPH)
        if _is_kernel(m)
        for n in ast.walk(ast.parse(MODULES[m].read_text()))
        if isinstance(n, ast.Attribute)
    }
    assert not names - called, (
        f"functions of kernels/_native.c no product kernel module calls: {sorted(names - called)}"
    )


def test_the_kernels_package_imports_nothing_eagerly() -> None:
    # A caller loads the kernel it uses and the native loader, nothing else.
    assert not GRAPH[KERNELS], GRAPH[KERNELS]
    code = "import sys, deck.kernels.claim; print(sorted(m for m in sys.modules if m.startswith('deck.kernels')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout.strip())) - {"deck.kernels._native"}
    assert loaded == {KERNELS, "deck.kernels.claim", "deck.kernels.native"}, loaded


def test_adapters_never_import_the_trainer() -> None:
    # One direction only: the trainer uses the adapters, never the other way round;
    # the hooks write into deck.model.RowRecorder, not the trainer's tracker class.
    for mod in GRAPH:
        if _package(mod) == "deck.adapters":
            deps = GRAPH[mod] | TYPING[mod]
            assert not {d for d in deps if _package(d) == "deck.trainer"}, mod


# ---- the demo and the test helpers stand on top ------------------------------------------------

DEMO = "deck.demo"
TESTING = "deck.testing"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _imports_of_the_tops(graph: dict[str, set[str]]) -> list[str]:
    """Imports that put a top under something: a module of deck importing the demo (only the
    test helpers may: they share its model builders with the tests and benchmarks), or a
    product module (outside deck.testing) importing a test helper."""
    bad = []
    for mod, deps in sorted(graph.items()):
        if _in(mod, TESTING):
            continue
        bad += [
            f"{mod} imports {dep}"
            for dep in sorted(deps)
            if (dep == DEMO and mod != DEMO) or _in(dep, TESTING)
        ]
    return bad


def test_nothing_of_deck_imports_the_demo_and_the_product_no_test_helper() -> None:
    graph = {mod: GRAPH[mod] | TYPING[mod] for mod in GRAPH}
    bad = _imports_of_the_tops(graph)
    assert not bad, (
        "the demo (the main job) and deck.testing are the top of the import graph; move what "
        "others need out of them (deck.processes: the ranks' helpers):\n" + "\n".join(bad)
    )


def test_the_tops_scan_finds_imports_of_the_demo_and_the_test_helpers() -> None:
    graph = {
        "deck.doctor.run": {"deck.demo", "deck.processes"},
        "deck.cli.inspect": {"deck.testing.synth"},
        "deck.testing.differential": {"deck.demo", "deck.testing.storage"},
        "deck.demo": {"deck", "deck.processes"},
    }
    assert _imports_of_the_tops(graph) == [
        "deck.cli.inspect imports deck.testing.synth",
        "deck.doctor.run imports deck.demo",
    ]


def test_the_demo_imports_deck_at_module_level() -> None:
    # Its place in the import graph is what it says at the top: no deck import hides in a
    # function.
    tree = ast.parse(MODULES[DEMO].read_text())
    top = {id(n) for n in tree.body}
    lazy = [
        f"{DEMO}:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        and id(n) not in top
        and (
            getattr(n, "level", 0)  # a relative import: of deck
            or any(
                _is_deck(m)
                for m in (
                    [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
                )
            )
        )
    ]
    assert not lazy, f"deck imports inside functions of the demo: {lazy}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (its strongly connected components of 2+ modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    cycles = _cycles(CYCLE_GRAPH)
    assert not cycles, f"import cycles (imports for type checking count inside a package): {cycles}"


def test_type_checking_imports_count_inside_a_package_only() -> None:
    staging = "deck.trainer.staging"
    # The commit thread's work item names the staged part for type checking only: an edge.
    assert f"{staging}.part" in TYPING[f"{staging}.committer"]
    assert f"{staging}.part" in CYCLE_GRAPH[f"{staging}.committer"]
    # A knot undone once: the part naming its stager, which imports the part.
    knot = {
        **CYCLE_GRAPH,
        f"{staging}.part": CYCLE_GRAPH[f"{staging}.part"] | {f"{staging}.stager"},
    }
    assert any({f"{staging}.part", f"{staging}.stager"} <= set(c) for c in _cycles(knot))
    # Across packages they do not count (``deck`` names its lazy exports for type checkers).
    assert "deck.trainer.checkpointer" in TYPING["deck"]
    assert "deck.trainer.checkpointer" not in CYCLE_GRAPH["deck"]


# ---- deck's private names stay in their module -------------------------------------------------


def _resolve(package: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in a module of ``package`` names."""
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(up + ([base] if base else []))
    return base


def _is_deck(module: str) -> bool:
    return module == "deck" or module.startswith("deck.")


def _private_imports(name: str, path: Path) -> list[str]:
    """``from M import _x`` in module ``name``, M another deck module (or package)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(package, node)
            if _is_deck(base) and base != name:
                out += [
                    f"{name}:{node.lineno}: from {base} import {a.name}"
                    for a in node.names
                    if _private(a.name)
                ]
    return out


def _own_names(tree: ast.AST) -> set[str]:
    """Every name a module defines: functions, classes, variables, and the attributes it sets
    (``x.name = ...``, ``setattr(x, "name", ...)``), at any level."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
    out |= {name for _, name, _ in _attribute_uses(tree, stores_only=True)}
    return out


def _foreign_modules(tree: ast.AST) -> set[str]:
    """Local names bound to modules or names of other libraries (``os``, ``argparse``, ...)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names if not _is_deck(a.name)}
        elif isinstance(n, ast.ImportFrom) and not n.level and not _is_deck(n.module or ""):
            out |= {a.asname or a.name for a in n.names}
    return out


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _class_privates(tree: ast.AST) -> dict[str, set[str]]:
    """Per class of a module: the private data attributes its methods set on ``self``."""
    out = {}
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            out[cls.name] = {
                n.attr
                for n in ast.walk(cls)
                if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Store)
                and getattr(n.value, "id", None) == "self"
                and _private(n.attr)
                and n.attr not in methods
            }
    return out


def _foreign_private_reads(
    name: str, source: str, class_privates: dict[str, dict[str, set[str]]], ignore: set[str]
) -> list[str]:
    """In module ``name``: ``obj._x`` on an object other than ``self``/``cls`` where no code of
    this module defines ``_x`` (a private name of another module's class), and ``self._x`` in
    a subclass of another deck module's class where that class keeps its own state in ``_x``
    (its protected methods are the subclass's hooks; its attributes are not). ``ignore``: names
    checked elsewhere (torch's private attributes: the compat module)."""
    tree = ast.parse(source)
    package = name.rsplit(".", 1)[0]
    own, foreign = _own_names(tree), _foreign_modules(tree)
    bad = []
    for line, attr, owner in _attribute_uses(tree):
        if not _private(attr) or attr in ignore or attr in own:
            continue
        if getattr(owner, "id", None) in ("self", "cls") or _root_name(owner) in foreign:
            continue
        bad.append(f"{name}:{line}: {attr} on {ast.unparse(owner)}")
    imported = {
        a.asname or a.name: _resolve(package, n)
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        for a in n.names
    }
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for base in cls.bases:
            where = imported.get(getattr(base, "id", ""), "")
            theirs = class_privates.get(where, {}).get(getattr(base, "id", ""), set())
            bad += [
                f"{name}:{line}: {cls.name} uses self.{attr} of {where}.{base.id}"  # type: ignore[attr-defined]
                for line, attr, owner in _attribute_uses(cls)
                if getattr(owner, "id", None) == "self" and attr in theirs and where != name
            ]
    return bad


def test_scanner_finds_private_names_of_other_modules(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import os\n"
        "from deck.x import _a, b\n"
        "from .y import _c\n"
        "from torch import _d\n"
        "from deck.y import Base\n"
        "class K(Base):\n"
        "    def f(self, w):\n"
        "        self._mine = w._step + w._here + os._exit(0)\n"
        "        self._state = self._hook()\n"
        "def g(v):\n"
        "    v._here = 1\n"
    )
    assert _private_imports("deck.z.m", src) == [
        "deck.z.m:2: from deck.x import _a",
        "deck.z.m:3: from deck.z.y import _c",
    ]
    privates = {"deck.y": {"Base": {"_state"}}}
    assert _foreign_private_reads("deck.z.m", src.read_text(), privates, set()) == [
        "deck.z.m:8: _step on w",
        "deck.z.m:9: K uses self._state of deck.y.Base",
    ]


def test_no_private_names_across_modules() -> None:
    compat = _compat_names()
    privates = {mod: _class_privates(ast.parse(path.read_text())) for mod, path in MODULES.items()}
    bad = []
    for mod, path in sorted(MODULES.items()):
        bad += _private_imports(mod, path)
        ignore = compat if path == COMPAT else set()
        bad += _foreign_private_reads(mod, path.read_text(), privates, ignore)
    assert not bad, (
        "a private name is used outside its module (make it public in its proper home):\n"
        + "\n".join(bad)
    )


@pytest.mark.parametrize(
    "module", ["deck", "deck.cli", "deck.ops.listing", "deck.ops.retention", "deck.read.lineage"]
)
def test_reading_tools_start_without_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'torchrec', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---- private attributes of torch / TorchRec / fbgemm: adapters/torchrec_compat.py only ----
COMPAT = ROOT / "adapters" / "torchrec_compat.py"


def _compat_names() -> set[str]:
    """PRIVATE_ATTRIBUTES of the compatibility module, read from its source (no torch import)."""
    for node in ast.parse(COMPAT.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and getattr(node.targets[0], "id", "") == "PRIVATE_ATTRIBUTES"
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError("adapters/torchrec_compat.py defines no PRIVATE_ATTRIBUTES")


def _attribute_uses(tree: ast.AST, stores_only: bool = False) -> list[tuple[int, str, ast.expr]]:
    """(line, name, owner) of every ``owner.name`` and ``getattr/hasattr/setattr(owner, "name")``
    (``stores_only``: of every ``setattr(owner, "name", ...)``)."""
    calls = ("setattr",) if stores_only else ("getattr", "hasattr", "setattr", "delattr")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not stores_only:
            out.append((node.lineno, node.attr, node.value))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in calls
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            out.append((node.lineno, node.args[1].value, node.args[0]))
    return out


def _foreign_private_uses(source: str, compat_names: set[str], scan_private: bool) -> list[str]:
    """Uses of the compat module's names, and (``scan_private``) of any ``_name`` on an object
    that is not ``self``/``cls``."""
    bad = []
    for line, name, owner in _attribute_uses(ast.parse(source)):
        if getattr(owner, "id", None) in ("self", "cls"):  # a class's own attributes
            continue
        if name in compat_names:
            bad.append(f"{line}: {name}")
        elif scan_private and name.startswith("_") and not name.startswith("__"):
            bad.append(f"{line}: {name} on {ast.unparse(owner)}")
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
        "6: _sharded_modules on r",
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


def _scheme_tests(tree: ast.AST) -> list[int]:
    """Lines that decide by a URI's scheme string: ``x.startswith("s3://")``, ``x == "kafka://"``,
    ``parts.scheme != "kafka"``, ``"memory://" in x``."""

    def uri_literal(n: ast.AST) -> bool:
        return isinstance(n, ast.Constant) and isinstance(n.value, str) and "://" in n.value

    def scheme_attr(n: ast.AST) -> bool:
        return isinstance(n, ast.Attribute) and n.attr in ("scheme", "protocol")

    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and any(uri_literal(a) for a in node.args)
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(uri_literal(s) for s in sides) or any(scheme_attr(s) for s in sides):
                lines.append(node.lineno)
    return lines


def test_scheme_strings_live_in_the_registry_only() -> None:
    """Which backend a URI opens, and what it can do, is decided by deck.schemes (by
    capability); no other product module tests a URI's scheme string."""
    bad = [
        f"{name}:{line}"
        for name, path in MODULES.items()
        if name != "deck.schemes" and not name.startswith("deck.testing")
        for line in _scheme_tests(ast.parse(path.read_text()))
    ]
    assert not bad, f"scheme tests outside deck.schemes: {bad}"


# Where a URI may become a Storage (with its storage_options): the command line, the top-level
# convenience functions, the storage factory itself, the doctor (deck.run_doctor, a top-level
# entry) and test helpers. The trainer gets its URIs from its config, not as parameters.
URI_EDGES = ("deck.cli", "deck.api", "deck.storage", "deck.doctor", "deck.testing", "deck.schemes")


def test_no_storage_options_parameter_below_the_edges() -> None:
    """Library functions take a Storage; only the edges open URIs."""
    bad = []
    for name, path in MODULES.items():
        if any(name == e or name.startswith(e + ".") for e in URI_EDGES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
                if "storage_options" in names:
                    bad.append(f"{name}.{node.name}")
    assert not bad, f"take a Storage instead of a URI and storage_options: {bad}"
