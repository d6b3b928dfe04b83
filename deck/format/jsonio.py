"""JSON from storage, decoded with a bound on its nesting.

Every JSON that deck reads from a URI (commit records, rank part manifests, pending, quarantine
and merge partition records, the structure of a state file) goes through :func:`load_json`. A
file written by someone else can nest arrays 100,000 levels deep: Python's decoder then raises
``RecursionError``, and whatever walks the result recursively afterwards (pydantic, the state
tree decoder, ``json.dumps`` for a checksum) may too. Here any such file is
:class:`~deck.errors.CorruptCheckpointError` naming it, like any other damage.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from collections.abc import Iterator
from typing import Any

from deck.errors import CorruptCheckpointError

# A record's deepest legitimate value is a segment's shape: rank manifest > shards > shard >
# chunks > chunk > segments > segment > shape (8 levels). Generous, so that adding a level to
# the format never needs a change here.
MAX_RECORD_DEPTH = 32


def depth_exceeds(value: Any, limit: int) -> bool:
    """Whether decoded JSON ``value`` nests dicts / lists more than ``limit`` levels deep (a
    scalar is depth 0, ``[]`` depth 1). Iterative, so it works on any input, and it stops at
    the first container past the limit."""
    if type(value) is not dict and type(value) is not list:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > limit:
            return True
        # Exact type tests: the decoder builds plain dicts and lists, and this loop runs once
        # per value of a record (a few percent of parsing a large rank manifest).
        for child in node.values() if type(node) is dict else node:
            kind = type(child)
            if kind is dict or kind is list:
                push((child, depth + 1))
    return False


def load_json(
    data: bytes | bytearray | memoryview | str,
    where: str,
    what: str = "JSON record",
    max_depth: int = MAX_RECORD_DEPTH,
) -> Any:
    """Decode ``data`` (the JSON ``what`` of file ``where``). Guarantees: returns a value nested
    at most ``max_depth`` levels, or raises :class:`CorruptCheckpointError` naming ``where``
    (invalid JSON, invalid UTF-8, or nested deeper); never ``RecursionError``."""
    raw = bytes(data) if isinstance(data, memoryview) else data
    try:
        value = json.loads(raw)
    except RecursionError:
        # The decoder's own guard against stack exhaustion: far past any limit of ours.
        value, deep = None, True
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(
            f"{where}: {what} is not valid JSON ({e}); the file is damaged or was not written "
            "by deck"
        ) from None
    else:
        # Nesting needs an opening bracket per level: a record with fewer brackets in all than
        # the limit (most: a commit record has a handful) cannot exceed it.
        opens = (
            raw.count("[") + raw.count("{")
            if isinstance(raw, str)
            else raw.count(b"[") + raw.count(b"{")
        )
        deep = opens > max_depth and depth_exceeds(value, max_depth)
    if deep:
        raise CorruptCheckpointError(
            f"{where}: {what} nests deeper than {max_depth} levels; the file is damaged or was "
            "not written by deck"
        )
    return value


_gc_lock = threading.Lock()
_gc_pausers = 0  # the paused_gc blocks running now, in every thread
_gc_resume = False  # whether the collector ran before the first of them


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a reader makes many long-lived objects
    at once: every commit record of a long history (some ten tracked objects each), its
    lineage graph, a listing's rows. While objects pile up the collector keeps walking all of
    them (a full collection each time they grew by a quarter): at 100,000 records that was
    as long as parsing them. Nothing is kept longer than it would be: reference counting frees
    what it always frees, and garbage in cycles waits for the first collection after the
    block. Nested and concurrent blocks (threads) count: the collector runs again when the
    last one ends, if it ran before the first began."""
    global _gc_pausers, _gc_resume
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_resume:
                gc.enable()
