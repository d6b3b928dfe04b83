"""The one registry of URI schemes: which scheme opens which backend, and what it can do.

Every place that turns a URI into something (the config's validators, ``open_storage``, the
publisher's sink, ``deck follow``) asks here, and decides by **capabilities**, never by a
scheme string:

- ``atomic_put``: a put makes an object visible whole or not at all (object stores, and local
  files through temp file + rename). deck writes nowhere else, so that no reader ever sees a
  prefix of a file; a scheme without it is refused at construction.
- ``atomic_create``: a create-if-absent is one conditional request (the writer lease's records).
- ``shared``: other processes and hosts see what one writes (``memory://`` lives in one
  process: a multi-rank job on it is refused at ``enable``).
- ``role``: ``storage`` opens a :class:`deck.storage.Storage`; ``publish`` is a publish sink only
  (``kafka://``: table rows travel through a topic, the rest through ``PublishConfig.state_uri``).

A backend of one's own registers with :func:`register` (before the config that names its scheme
is built), e.g. a storage class for ``myfs://``::

    deck.schemes.register(deck.schemes.Scheme(
        "myfs", opener="mypackage.storage:MyFsStorage", atomic_put=True, shared=True))

The opener is ``"module:attribute"`` (imported on first use, so that validating a config loads
no backend) or a callable; a ``storage`` opener is called as ``opener(uri, storage_options)``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Literal

from deck.errors import ConfigError

logger = logging.getLogger(__name__)
Role = Literal["storage", "publish"]
LOCAL = "file"  # the scheme of a plain path


@dataclass(frozen=True)
class Scheme:
    """One URI scheme: its backend (``opener``) and its capabilities (see the module doc)."""

    name: str
    opener: str | Callable[..., Any]
    atomic_put: bool = True
    atomic_create: bool = False
    shared: bool = True
    role: Role = "storage"
    # A publish sink opened again by a staging process (``staging.mode="process"``) over that
    # process's own state store, with the opener's arguments; without it the publisher's
    # staging runs in the training process.
    reopener: str | Callable[..., Any] | None = None

    def open(self, *args: Any) -> Any:
        """Call the opener (importing it first when given as ``"module:attribute"``); a
        backend that cannot be loaded is a :class:`ConfigError` naming the scheme."""
        return self._call(self.opener, *args)

    def reopen(self, *args: Any) -> Any:
        """Call the :attr:`reopener` as :meth:`open` calls the opener."""
        if self.reopener is None:
            raise ConfigError(f"{self.name}:// cannot be opened by a staging process")
        return self._call(self.reopener, *args)

    def _call(self, opener: str | Callable[..., Any], *args: Any) -> Any:
        if not isinstance(opener, str):
            return opener(*args)
        module, _, attr = opener.partition(":")
        try:
            found = getattr(import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"the backend of {self.name}:// ({opener}) cannot be loaded: {e}"
            ) from e
        return found(*args)


_FSSPEC = "deck.storage.fsspec_store:FsspecStorage"
_LOCAL = "deck.storage:open_local"
_lock = threading.Lock()
_registry: dict[str, Scheme] = {}


_BUILTIN: set[str] = set()  # deck's own schemes: replaced only when asked (replace=True)
ENTRY_POINTS = "deck.schemes"  # the entry-point group other packages register schemes in
_entry_points_loaded = False


def register(scheme: Scheme, *, replace: bool = False) -> None:
    """Make ``scheme.name`` usable in every URI deck takes (replacing an earlier registration
    of the same name; one of deck's own only with ``replace=True``). Raises
    :class:`ConfigError` for a name that is not a lowercase URI scheme, an unknown role, or an
    opener that is neither callable nor ``"module:attribute"``."""
    name = scheme.name
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9+.-]*", name):
        raise ConfigError(f"scheme name {name!r}: lowercase letters, digits, '+', '.', '-'")
    if scheme.role not in ("storage", "publish"):
        raise ConfigError(
            f"scheme {name}: role must be 'storage' or 'publish', got {scheme.role!r}"
        )
    opener = scheme.opener
    if not callable(opener) and not (
        isinstance(opener, str) and re.fullmatch(r"[\w.]+:\w+", opener)
    ):
        raise ConfigError(
            f"scheme {name}: opener must be a callable or 'module:attribute', got {opener!r}"
        )
    with _lock:
        if name in _BUILTIN and not replace:
            raise ConfigError(
                f"scheme {name}:// is deck's own; register(..., replace=True) to replace it"
            )
        _registry[name] = scheme


def unregister(name: str) -> None:
    """Forget the scheme ``name`` (nothing if it is not registered; deck's own stay)."""
    with _lock:
        if name in _BUILTIN:
            raise ConfigError(f"scheme {name}:// is deck's own and cannot be unregistered")
        _registry.pop(name, None)


def _load_entry_points() -> None:
    """Schemes other packages declare (entry-point group :data:`ENTRY_POINTS`, each a
    :class:`Scheme`), loaded once, the first time a URI's scheme is not known: so a backend
    installed as a package works in every process, ``deck`` commands and spawned workers
    included."""
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS):
        try:
            register(ep.load())
        except Exception as e:  # a broken plugin must not break the URIs of the others
            logger.warning(
                "deck: the deck.schemes entry point %s (%s) is unusable: %s", ep.name, ep.value, e
            )


for _s in (
    Scheme(LOCAL, _LOCAL, atomic_create=True),  # hard link of a complete temp file
    Scheme("local", _LOCAL, atomic_create=True),
    Scheme("s3", _FSSPEC, atomic_create=True),  # If-None-Match: * (AWS S3, SeaweedFS)
    Scheme("s3a", _FSSPEC, atomic_create=True),
    Scheme("gs", _FSSPEC),
    Scheme("gcs", _FSSPEC),
    Scheme("az", _FSSPEC),
    Scheme("abfs", _FSSPEC),
    Scheme("abfss", _FSSPEC),
    Scheme("memory", _FSSPEC, shared=False),
    Scheme(
        "kafka",
        "deck.trainer.kafka_sink:open_kafka_sink",
        role="publish",
        reopener="deck.trainer.kafka_sink:reopen_kafka_sink",
    ),
):
    register(_s)
    _BUILTIN.add(_s.name)


def path_of(uri: str) -> str:
    """What follows the scheme of ``uri`` (all of a plain path)."""
    if scheme_name(uri) == LOCAL and not uri.startswith(f"{LOCAL}://"):
        return uri
    return uri.partition("://")[2]


def registered() -> list[Scheme]:
    """Every registered scheme, by name."""
    with _lock:
        return [_registry[n] for n in sorted(_registry)]


_RFC_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def scheme_name(uri: str) -> str:
    """The scheme of ``uri`` as written; :data:`LOCAL` for a plain path. What precedes ``://``
    is a scheme when it is one (RFC 3986) or a chain of them (``a::b``, never supported);
    otherwise ``uri`` is a path that happens to contain ``://`` (``/tmp/a://b``)."""
    head, sep, _ = uri.partition("://")
    if not sep:
        return LOCAL
    if _RFC_SCHEME.fullmatch(head) or "::" in head:
        return head
    return LOCAL


def is_local(uri: str) -> bool:
    """Whether ``uri`` is a plain path or ``file://``/``local://``: a folder on this host."""
    found = _find(scheme_name(uri))
    return found is not None and found.opener == _LOCAL


def is_publish_sink(uri: str) -> bool:
    """Whether ``uri``'s scheme is a publish sink only (``kafka://``), not a store."""
    found = _find(scheme_name(uri))
    return found is not None and found.role == "publish"


def location(uri: str) -> str:
    """Where ``uri`` points, normalised so that two spellings of one place compare equal (a
    local path resolved, ``file://`` and ``local://`` dropped, the scheme lowercased, no
    trailing ``/``): for "these two must not be the same place" checks."""
    import os

    if is_local(uri):
        return "file://" + os.path.realpath(os.path.expanduser(path_of(uri)))
    name = scheme_name(uri)
    return f"{name.lower()}://{path_of(uri).strip('/')}"


def lookup(uri: str, role: Role = "storage") -> Scheme:
    """The registered scheme of ``uri`` for ``role`` (a ``publish`` role also takes every
    storage scheme: a publisher writes files too). Raises ``ValueError`` (pydantic validators
    turn it into a ConfigError naming the field) saying what is wrong and what is supported:
    an unknown or mixed-case scheme, a chained URI, a path that looks like a mistyped URI
    (``s3:/bucket``), a URI naming no place, or a scheme without an atomic put."""
    name = scheme_name(uri)
    if name == LOCAL and not uri.startswith(f"{LOCAL}://"):
        typo = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):(?!//)", uri)
        if typo and len(typo.group(1)) > 1:  # (one letter: a drive, never on this platform)
            raise ValueError(
                f"{uri!r} looks like a URI with a mistyped scheme ({typo.group(1)}: without //): "
                f"write {typo.group(1)}://..., or ./{uri} for a local folder of that name"
            )
    elif not path_of(uri).strip("/"):
        raise ValueError(f"{uri!r} names no place after {name}://: give a bucket, prefix or path")
    found = _find(name)
    if "::" in uri and (found is None or found.role == "storage"):
        raise ValueError(
            f"scheme {name!r} is not supported in {uri!r}: chained URIs (a::b://, or :: in the "
            f"path) would be read by fsspec as another store; {_supported(role)}"
        )
    if found is None and name != name.lower() and _find(name.lower()) is not None:
        raise ValueError(f"scheme {name!r}: schemes are lowercase, write {name.lower()}://")
    if found is not None and not found.atomic_put:
        raise ValueError(
            f"scheme {name!r} is not supported: it is registered without atomic_put, and deck "
            "writes only where a put makes an object visible whole or not at all"
        )
    if found is None or (found.role == "publish" and role == "storage"):
        what = " (a publish sink, not a store)" if found is not None else ""
        raise ValueError(f"scheme {name!r} is not supported here{what}: {_supported(role)}")
    return found


def _supported(role: Role) -> str:
    """What a refusal lists: every scheme ``lookup`` accepts for ``role``, the local ones
    (``file://``, ``local://``: a folder on this host, like a plain path) apart."""
    with _lock:
        usable = sorted(
            (n, s.opener == _LOCAL)
            for n, s in _registry.items()
            if s.atomic_put and (s.role == "storage" or s.role == role)
        )
    local = " or ".join(n + "://" for n, here in usable if here)
    stores = ", ".join(n + "://" for n, here in usable if not here)
    return (
        f"use a local path ({local} also name one) or one of {stores} (stores whose put is "
        "atomic; mount any other store and give its path, or register a backend: deck.schemes)"
    )


def _find(name: str) -> Scheme | None:
    with _lock:
        found = _registry.get(name)
    if found is None and not _entry_points_loaded:
        _load_entry_points()
        with _lock:
            found = _registry.get(name)
    return found


def open_backend(uri: str, storage_options: dict[str, Any] | None) -> Any:
    """The storage of ``uri`` from its registered opener (``open_storage`` calls this).
    Raises :class:`ConfigError` for an unsupported scheme."""
    try:
        scheme = lookup(uri)
    except ValueError as e:
        raise ConfigError(f"storage URI {uri}: {e}") from e
    return scheme.open(uri, storage_options)
