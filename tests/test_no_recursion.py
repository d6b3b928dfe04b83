"""No recursion whose depth grows with history: every function of the product (deck, deck.kernels,
deck.adapters) that calls itself, directly or through other functions of its module, is named
below with why its depth is bounded.

A walk over lineage nodes, chains or planned items that recursed once per checkpoint made
``deck merge`` fail with RecursionError from about a thousand deltas on, every pass. Such walks
use loops and explicit stacks; this scan keeps new ones from recursing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = [ROOT / "deck", ROOT / "kernels", ROOT / "adapters"]

# (file relative to the repository root, qualified function name) -> why its depth is bounded.
BOUNDED = {
    ("deck/format/treecodec.py", "capture.walk"): (
        "a state tree being saved: refuses nesting past MAX_TREE_DEPTH before recursing deeper"
    ),
    ("deck/format/treecodec.py", "_walk_fast"): (
        "the fast walk of the same tree: stops at MAX_TREE_DEPTH (capture.walk then names it)"
    ),
    ("deck/format/treecodec.py", "decode.build"): (
        "a decoded state tree: load_json refused it (iteratively) if deeper than MAX_TREE_DEPTH"
    ),
    ("deck/ops/export/dense.py", "flatten"): (
        "the dense state decoded from a state file: nested at most MAX_TREE_DEPTH (decode checks)"
    ),
    ("deck/docgen.py", "_type_name"): "a type annotation of deck's own settings: a few levels",
    ("deck/doctor/capture.py", "_flatten"): (
        "a model's state_dict and the user's state the doctor is checking: the nesting of that "
        "one state (the user's state is saved through treecodec, which caps it)"
    ),
    ("deck/demo.py", "state_leaves"): (
        "TorchRec / torch optimizer state_dicts of the demo model: a fixed few levels"
    ),
    ("deck/testing/differential.py", "_flat"): "the test harness's own user state: two levels",
    ("deck/testing/lineage_checks.py", "set_store_time"): (
        "a test's storage wrappers around one store: one per wrapper, a level or two"
    ),
    ("adapters/torchrec_optim.py", "flatten"): (
        "the user's optimizer tree (CombinedOptimizer / OptimizerWrapper): a few levels"
    ),
    ("adapters/torchrec_optim.py", "wrappers"): "the same optimizer tree",
    ("adapters/torchrec_optim.py", "fused_leaves"): "the same optimizer tree",
}


class _Functions(ast.NodeVisitor):
    """Every function of a module by qualified name (``f``, ``Class.m``, ``f.inner``), with the
    names a bare call inside it can reach (its enclosing functions' locals, then the module's;
    a class body is no scope for its methods) and its class for ``self.x()`` calls."""

    def __init__(self) -> None:
        self.defs: dict[str, tuple[ast.AST, list[str], str | None]] = {}
        self._scopes: list[str] = []  # qualified names of the enclosing functions
        self._prefix: list[str] = []
        self._cls: str | None = None

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer_cls = self._cls
        self._cls = ".".join([*self._prefix, node.name])
        self._prefix.append(node.name)
        self.generic_visit(node)
        self._prefix.pop()
        self._cls = outer_cls

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        qual = ".".join([*self._prefix, node.name])
        self.defs[qual] = (node, list(self._scopes), self._cls)
        outer_cls = self._cls
        self._prefix.append(node.name)
        self._scopes.append(qual)
        self._cls = None  # a function nested in a method has no ``self`` of its own
        self.generic_visit(node)
        self._cls = outer_cls
        self._scopes.pop()
        self._prefix.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function


def _own_calls(node: ast.AST) -> list[ast.Call]:
    """The calls in ``node``'s body (its lambdas' included: they run from it), not in the
    functions or classes defined inside it."""
    out: list[ast.Call] = []
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(n, ast.Call):
            out.append(n)
        todo.extend(ast.iter_child_nodes(n))
    return out


def _call_graph(source: str) -> dict[str, set[str]]:
    """Which functions of the module each function calls (by bare name or ``self.``/``cls.``)."""
    found = _Functions()
    found.visit(ast.parse(source))
    graph: dict[str, set[str]] = {}
    for qual, (node, scopes, cls) in found.defs.items():
        callees: set[str] = set()
        for call in _own_calls(node):
            f = call.func
            if isinstance(f, ast.Name):
                # Innermost scope first: a nested function, a sibling nested one, a module one.
                for scope in [qual, *reversed(scopes), ""]:
                    target = f"{scope}.{f.id}" if scope else f.id
                    if target in found.defs:
                        callees.add(target)
                        break
            elif (
                isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and cls is not None
                and f.value.id in ("self", "cls", cls.rsplit(".", 1)[-1])
                and f"{cls}.{f.attr}" in found.defs
            ):
                callees.add(f"{cls}.{f.attr}")
        graph[qual] = callees
    return graph


def recursive_functions(source: str) -> list[str]:
    """The functions of ``source`` that can call themselves (directly, or through other
    functions of the same module), sorted."""
    graph = _call_graph(source)
    out = []
    for f in graph:
        seen: set[str] = set()
        todo = list(graph[f])
        while todo:
            g = todo.pop()
            if g == f:
                out.append(f)
                break
            if g not in seen:
                seen.add(g)
                todo.extend(graph.get(g, ()))
    return sorted(out)


def _scan() -> dict[tuple[str, str], int]:
    found = {}
    for folder in FOLDERS:
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for name in recursive_functions(path.read_text()):
                found[(rel, name)] = 1
    return found


def test_no_recursion_but_the_bounded_ones() -> None:
    found = _scan()
    unexplained = sorted(k for k in found if k not in BOUNDED)
    assert not unexplained, (
        f"recursive functions {unexplained}: a walk over lineage nodes, chains or planned items "
        "must be a loop (its depth grows with history); a recursion whose depth is bounded by "
        "something else goes into BOUNDED with why"
    )
    stale = sorted(k for k in BOUNDED if k not in found)
    assert not stale, f"BOUNDED names functions that no longer recurse: {stale}"


def test_the_scan_finds_direct_nested_method_and_mutual_recursion() -> None:
    source = """
def direct(n):
    return direct(n - 1) if n else 0

def outer(xs):
    def inner(x):
        return [inner(y) for y in x]
    return inner(xs)

class Walker:
    def walk(self, n):
        return self.walk(n - 1) if n else 0

    def list(self):
        return list(range(3))  # the builtin: a class body is no scope for its methods

def ping(n):
    return pong(n - 1) if n else 0

def pong(n):
    return ping(n)

def loop(n):
    out = []
    while n:
        out.append(n)
        n -= 1
    return out

def calls_another_helper(n):
    return loop(n)

def shadowed():
    def helper():
        return 1
    return helper()

def helper():
    return shadowed()
"""
    assert recursive_functions(source) == [
        "Walker.walk",
        "direct",
        "outer.inner",
        "ping",
        "pong",
    ]
