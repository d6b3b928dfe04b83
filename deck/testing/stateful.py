"""A state machine that runs random sequences of :class:`deck.storage.Storage` calls on a store and
on a memory store side by side and compares every answer (like zarr's
``zarr.testing.stateful.ZarrStoreStateMachine``).

Rules: put, get (whole and ranged, valid and invalid ranges), size, exists, list, list_dir,
delete, delete_prefix; a plain dict of what was put is the invariant that keeps the memory store
itself honest. Keys are drawn from a small set (folders ``d1``, ``d2`` up to two deep, files
``x``, ``y``, ``xy``, ``z.bin``) so that sequences revisit keys, prefixes and folders; a file name
is never a folder name, since a local file system cannot hold both at one path.

One difference between backends is allowed and not compared: a local store's :meth:`list_dir`
still names a folder whose objects were all deleted (folders are real there), an object store's
does not (it has none). Compared are the folders that hold objects.

Usage (a fresh, empty store per example)::

    check_against_memory(lambda: LocalStorage(tmp_path / uuid.uuid4().hex))

Needs hypothesis; deck itself never imports this module.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from deck.errors import ConfigError, NotFoundError
from deck.storage import FsspecStorage, Storage

__all__ = ["KEYS", "PREFIXES", "StorageStateMachine", "check_against_memory"]

_FOLDERS = ["", "d1/", "d2/", "d1/d1/", "d1/d2/", "d2/d1/"]
KEYS = [f + leaf for f in _FOLDERS for leaf in ("x", "y", "xy", "z.bin")]
"""Every key a sequence may use."""
PREFIXES = sorted({k[:i] for k in KEYS for i in range(len(k) + 1)} | {"none/", "d3"})
"""Every listing prefix a sequence may use: each prefix of a key, and two that match nothing."""

_keys = st.sampled_from(KEYS)
_data = st.binary(max_size=96)
_offsets = st.integers(min_value=0, max_value=120)


class StorageStateMachine(RuleBasedStateMachine):
    """Compares ``make_store()`` with a memory store, call by call (subclass with ``make_store``
    set, or use :func:`check_against_memory`)."""

    make_store: Callable[[], Storage]

    def __init__(self) -> None:
        super().__init__()
        self.store = type(self).make_store()
        self.reference = FsspecStorage(f"memory://deck-reference-{uuid.uuid4().hex}")
        self.model: dict[str, bytes] = {}

    def _both(self, call: Callable[[Storage], Any]) -> Any:
        """``call`` on both stores: the same result, or the same kind of error."""
        got, want = _outcome(call, self.store), _outcome(call, self.reference)
        assert got == want, f"{self.store!r}: {got!r}, memory store: {want!r}"
        return want

    def _key(self, data: st.DataObject) -> str:
        """A key for a read or a delete: mostly one that holds an object, else any."""
        held = sorted(self.model)
        if held and data.draw(st.integers(0, 3), label="existing?") > 0:
            return data.draw(st.sampled_from(held), label="key")
        return data.draw(_keys, label="key")

    @rule(items=st.dictionaries(_keys, _data, min_size=1, max_size=3))
    def put(self, items: dict[str, bytes]) -> None:
        for key, value in items.items():
            self._put(key, value)

    def _put(self, key: str, value: bytes) -> None:
        self._both(lambda s: s.put(key, value))
        self.model[key] = value

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        key = self._key(data)
        self._both(lambda s: s.get(key))

    @rule(data=st.data(), start=_offsets, length=st.none() | _offsets)
    def get_range(self, data: st.DataObject, start: int, length: int | None) -> None:
        key, end = self._key(data), None if length is None else start + length
        self._both(lambda s: s.get(key, start, end))

    @rule(data=st.data(), start=_offsets, short=st.integers(min_value=1, max_value=10))
    def get_invalid_range(self, data: st.DataObject, start: int, short: int) -> None:
        key = self._key(data)
        assert self._both(lambda s: s.get(key, start + short, start))[0] is ConfigError

    @rule(data=st.data())
    def size_exists(self, data: st.DataObject) -> None:
        key = self._key(data)
        self._both(lambda s: s.size(key))
        assert self._both(lambda s: s.exists(key)) == ("ok", key in self.model)

    @rule(data=st.data())
    def list_keys(self, data: st.DataObject) -> None:
        # Mostly the root or a cut of a key that holds an object (listings of several keys).
        how = data.draw(st.integers(0, 2), label="prefix from")
        if how == 0 or not self.model:
            prefix = data.draw(st.sampled_from(PREFIXES), label="prefix")
        elif how == 1:
            prefix = ""
        else:
            key = data.draw(st.sampled_from(sorted(self.model)), label="cut of")
            prefix = key[: data.draw(st.integers(0, len(key)), label="cut at")]
        self._both(lambda s: s.list(prefix))

    @rule(folder=st.sampled_from([*_FOLDERS, "none/"]))
    def list_folder(self, folder: str) -> None:
        occupied = {
            k[len(folder) :].partition("/")[0] + "/" for k in self.model if k.startswith(folder)
        }

        def names(s: Storage) -> list[str]:
            # Only folders that hold objects (see the module docstring).
            return [n for n in s.list_dir(folder) if not n.endswith("/") or n in occupied]

        self._both(names)

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        key = self._key(data)
        self._both(lambda s: s.delete(key))
        self.model.pop(key, None)

    @rule(folder=st.sampled_from(_FOLDERS[1:]))
    def delete_prefix(self, folder: str) -> None:
        self._both(lambda s: s.delete_prefix(folder))
        self.model = {k: v for k, v in self.model.items() if not k.startswith(folder)}

    @invariant()
    def reference_holds_the_model(self) -> None:
        assert self.reference.list() == sorted(self.model)

    def teardown(self) -> None:
        for s in (self.store, self.reference):
            s.delete_prefix("")


def _outcome(call: Callable[[Storage], Any], store: Storage) -> tuple[Any, Any]:
    """("ok", result), or (error class, None) for the errors the contract names."""
    try:
        return "ok", call(store)
    except (NotFoundError, ConfigError) as e:
        return type(e), None


_machines = itertools.count()


def check_against_memory(
    make_store: Callable[[], Storage], *, max_examples: int = 50, steps: int = 40
) -> None:
    """Run :class:`StorageStateMachine` on stores from ``make_store`` (a fresh, empty one per
    example): ``max_examples`` sequences of up to ``steps`` calls each, no example database.
    Fails (with hypothesis' shrunk sequence) at the first answer that differs."""
    machine = type(
        f"StorageStateMachine{next(_machines)}",
        (StorageStateMachine,),
        {"make_store": staticmethod(make_store)},
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
