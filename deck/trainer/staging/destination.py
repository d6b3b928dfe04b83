"""The checkpoint's destination as the stager's threads use it: outages are waited out."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

from deck.config import StagingConfig
from deck.errors import (
    CorruptCheckpointError,
    DeckError,
    NotFoundError,
    StorageError,
    UnsafePathError,
)
from deck.format.manifest import MANIFEST, CheckpointManifest, load_model, step_dir
from deck.storage import Storage
from deck.storage.base import get_bounded
from deck.storage.retry import RetryPolicy, call_with_retry

T = TypeVar("T")


class Destination:
    """``storage`` with every read and write retried for as long as ``upload_timeout_s``.

    Used by the upload threads (files of the ``cpu-remote`` tier, and uploads from the spool),
    the commit thread (part manifests, commit checks) and restart recovery (what is there).
    """

    def __init__(self, storage: Storage, cfg: StagingConfig) -> None:
        self.storage = storage
        self.cfg = cfg

    def put(self, key: str, data: bytes | bytearray) -> None:
        self.retrying("upload", key, lambda: self.storage.put(key, data))

    def exists(self, key: str) -> bool:
        return self.retrying("read", key, lambda: self.storage.exists(key))

    def committed_id(self, step: int) -> str | None:
        """The id of the checkpoint committed at ``step``, if any (an unreadable record: none)."""
        key = f"{step_dir(step)}/{MANIFEST}"

        def read() -> bytes | None:
            try:
                return get_bounded(self.storage, key)
            except (NotFoundError, CorruptCheckpointError):  # too large, a link, a FIFO, ...
                return None

        data = self.retrying("read", key, read)
        if data is None:
            return None
        try:
            return load_model(CheckpointManifest, data, self.storage.describe(step_dir(step))).id
        except DeckError:
            return None

    def delete_files(self, step: int, files: list[str]) -> None:
        """Best effort, no retries: files of a part that will not be committed."""
        for rel in files:
            with contextlib.suppress(OSError, StorageError):
                self.storage.delete(f"{step_dir(step)}/{rel}")

    def retrying(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """``fn`` with backoff for as long as ``upload_timeout_s``: outages are waited out (the
        store's own retries only cover short blips). Every storage error is retried."""
        policy = RetryPolicy(
            attempts=None,
            deadline_s=self.cfg.upload_timeout_s,
            initial_delay=min(self.cfg.retry_initial_s, self.cfg.retry_max_s),
            max_delay=self.cfg.retry_max_s,
            jitter=0.0,
            # A link or special file in the way (UnsafePathError) does not go away by waiting.
            retry_on=lambda e: isinstance(e, StorageError) and not isinstance(e, UnsafePathError),
        )
        try:
            return call_with_retry(fn, policy, f"deck: {what} of {self.storage.describe(key)}")
        except UnsafePathError:
            raise
        except StorageError as e:
            raise StorageError(
                f"giving up on {what} of {self.storage.describe(key)} after "
                f"{self.cfg.upload_timeout_s:.0f} s: {e}"
            ) from e
