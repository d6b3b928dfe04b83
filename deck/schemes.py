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

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Literal

from deck.errors import ConfigError

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

    def open(self, *args: Any) -> Any:
        """Call the opener (importing it first when given as ``"module:attribute"``)."""
        opener = self.opener
        if isinstance(opener, str):
            module, _, attr = opener.partition(":")
            opener = getattr(import_module(module), attr)
        return opener(*args)


_FSSPEC = "deck.storage.fsspec_store:FsspecStorage"
_LOCAL = "deck.storage:open_local"
_lock = threading.Lock()
_registry: dict[str, Scheme] = {}


def register(scheme: Scheme) -> None:
    """Make ``scheme.name`` usable in every URI deck takes (replacing a registration of the
    same name). Raises :class:`ConfigError` for a name that is not a URI scheme."""
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme.name):
        raise ConfigError(f"scheme name {scheme.name!r}: lowercase letters, digits, '+', '.', '-'")
    with _lock:
        _registry[scheme.name] = scheme


def unregister(name: str) -> None:
    """Forget the scheme ``name`` (nothing if it is not registered)."""
    with _lock:
        _registry.pop(name, None)


for _s in (
    Scheme(LOCAL, _LOCAL),
    Scheme("local", _LOCAL),
    Scheme("s3", _FSSPEC, atomic_create=True),  # If-None-Match: * (AWS S3, SeaweedFS)
    Scheme("s3a", _FSSPEC, atomic_create=True),
    Scheme("gs", _FSSPEC),
    Scheme("gcs", _FSSPEC),
    Scheme("az", _FSSPEC),
    Scheme("abfs", _FSSPEC),
    Scheme("abfss", _FSSPEC),
    Scheme("memory", _FSSPEC, shared=False),
    Scheme("kafka", "deck.trainer.kafka_sink:open_kafka_sink", role="publish"),
):
    register(_s)


def path_of(uri: str) -> str:
    """What follows the scheme of ``uri`` (all of a plain path)."""
    return uri.partition("://")[2] or uri


def registered() -> list[Scheme]:
    """Every registered scheme, by name."""
    with _lock:
        return [_registry[n] for n in sorted(_registry)]


def scheme_name(uri: str) -> str:
    """The scheme of ``uri``, lowercase; :data:`LOCAL` for a plain path."""
    # Whatever precedes "://" (so that a chained "a::b://" URI is a scheme of its own, unknown)
    return uri.split("://", 1)[0].lower() if "://" in uri else LOCAL


def is_local(uri: str) -> bool:
    """Whether ``uri`` is a plain path or ``file://``/``local://``: a folder on this host."""
    with _lock:
        found = _registry.get(scheme_name(uri))
    return found is not None and found.opener == _LOCAL


def is_publish_sink(uri: str) -> bool:
    """Whether ``uri``'s scheme is a publish sink only (``kafka://``), not a store."""
    with _lock:
        found = _registry.get(scheme_name(uri))
    return found is not None and found.role == "publish"


def lookup(uri: str, role: Role = "storage") -> Scheme:
    """The registered scheme of ``uri`` for ``role`` (a ``publish`` role also takes every
    storage scheme: a publisher writes files too). Raises ``ValueError`` (pydantic validators
    turn it into a ConfigError naming the field) saying which schemes are supported."""
    name = scheme_name(uri)
    with _lock:
        found = _registry.get(name)
        usable = sorted(
            n
            for n, s in _registry.items()
            if s.atomic_put and (s.role == "storage" or s.role == role) and n != LOCAL
        )
    if found is None or not found.atomic_put or (found.role == "publish" and role == "storage"):
        raise ValueError(
            f"scheme {name!r} is not supported here: use a local path or one of "
            f"{', '.join(n + '://' for n in usable)} (stores whose put is atomic; "
            "mount any other store and give its path, or register a backend: deck.schemes)"
        )
    return found


def open_backend(uri: str, storage_options: dict[str, Any] | None) -> Any:
    """The storage of ``uri`` from its registered opener (``open_storage`` calls this).
    Raises :class:`ConfigError` for an unsupported scheme."""
    try:
        scheme = lookup(uri)
    except ValueError as e:
        raise ConfigError(f"storage URI {uri}: {e}") from e
    return scheme.open(uri, storage_options)
