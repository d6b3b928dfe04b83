"""Storage backends: one :class:`Storage` interface, a local and an fsspec implementation, and a
forwarding :class:`StorageWrapper` to build wrappers on. Local files outside a store are written
with :mod:`deck.storage.atomic`; retries go through :mod:`deck.storage.retry`."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import deck.schemes as schemes
from deck.errors import ConfigError, StorageError
from deck.storage.base import Storage
from deck.storage.fsspec_store import FsspecStorage
from deck.storage.local import LocalStorage
from deck.storage.retry import RetryPolicy
from deck.storage.wrapper import StorageWrapper

logger = logging.getLogger(__name__)

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "RetryPolicy",
    "Storage",
    "StorageWrapper",
    "check_writable",
    "open_local",
    "open_storage",
]

PROBE_PREFIX = ".deck-probe-"


def open_storage(uri: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """Open the :class:`Storage` for ``uri``.

    - A plain path (``~`` expanded, made absolute) or a ``file://`` URI gives a
      :class:`LocalStorage` (atomic rename commit); ``storage_options`` are ignored for it.
    - An object store or memory URI (``s3://``, ``gs://``, ``az://``, ``memory://``: the
      schemes whose put is atomic, registered in :mod:`deck.schemes`) gives an
      :class:`FsspecStorage`, with ``storage_options`` passed to the fsspec filesystem; any
      other scheme (sftp, ftp, smb, hdfs, http, ...) raises :class:`ConfigError` naming it,
      since a reader could see a prefix of a file it writes in place. A scheme registered with
      :func:`deck.schemes.register` opens its own backend. For ``s3://`` the
      ``storage_options`` are s3fs options, e.g. for an S3-compatible server (MinIO, SeaweedFS)::

          open_storage("s3://bucket/run-1", {
              "key": "...", "secret": "...",
              "client_kwargs": {"endpoint_url": "http://host:8333", "region_name": "us-east-1"},
          })

      Without ``key``/``secret`` s3fs uses the usual AWS credential chain (environment,
      ``~/.aws``, instance role). botocore retries each request itself (``config_kwargs=
      {"retries": {"max_attempts": N}}`` tunes it) underneath deck's own
      :class:`RetryPolicy`.

    Nothing is created or contacted here; use :func:`check_writable` to fail early.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(f"storage URI must be a non-empty string, got {uri!r}")
    storage = schemes.open_backend(uri, storage_options)
    if not isinstance(storage, Storage):
        raise ConfigError(
            f"storage URI {uri}: the backend registered for its scheme returned "
            f"{type(storage).__name__}, not a deck.storage.Storage"
        )
    return storage


def open_local(uri: str, storage_options: dict[str, Any] | None = None) -> LocalStorage:
    """The :class:`LocalStorage` of a plain path (``~`` expanded, made absolute) or a
    ``file://`` / ``local://`` URI; ``storage_options`` are ignored (logged)."""
    path = schemes.path_of(uri)
    if storage_options:
        logger.warning("storage_options %s ignored for local path %s", storage_options, uri)
    return LocalStorage(os.path.abspath(os.path.expanduser(path)))


def check_writable(storage: Storage) -> None:
    """Check that ``storage`` accepts writes and deletes, by writing and deleting a probe object.

    The probe is a tiny object named ``.deck-probe-<uuid>`` at the root. Raises
    :class:`StorageError` naming the URI when either step fails.
    """
    key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        storage.put(key, b"deck write probe\n")
        storage.delete(key)
    except OSError as exc:  # StorageError is an OSError; so are raw errors of a custom Storage
        raise StorageError(
            f"URI {storage.uri} is not writable: {exc}; pass a directory/bucket you can write to"
        ) from exc
