"""Typed errors. Every deck failure a user can act on is a :class:`DeckError`.

Messages name the URI / file / step / table involved and say what to do next.
"""

from __future__ import annotations

from typing import Any


class DeckError(Exception):
    """Base class of all deck errors."""


class ConfigError(DeckError, ValueError):
    """A configuration value is invalid.

    Raised by every deck configuration model (``DeckConfig(...)``, ``model_validate``,
    ``model_validate_json``, ``model_copy(update=...)``) instead of pydantic's
    ``ValidationError``; both are ``ValueError``. :meth:`errors` returns pydantic's error
    records (``loc``, ``msg``, ``type``, ``input``) when the error came from validation."""

    def __init__(self, message: str, *, errors: list[Any] | None = None) -> None:
        super().__init__(message)
        self._errors = list(errors or [])

    def errors(self) -> list[Any]:
        """pydantic's error records (as ``ValidationError.errors()``); empty when the error did
        not come from validating a model."""
        return list(self._errors)

    def error_count(self) -> int:
        """How many error records :meth:`errors` holds."""
        return len(self._errors)


class StorageError(DeckError, OSError):
    """Reading from or writing to a storage URI failed."""


class NotFoundError(StorageError, FileNotFoundError):
    """A file that should exist at a storage URI does not."""


class CorruptCheckpointError(DeckError):
    """A checkpoint file failed validation (checksum, size, schema)."""


class CheckpointNotFoundError(DeckError, LookupError):
    """No committed checkpoint matches the request."""


class IncompatibleModelError(DeckError):
    """The checkpoint cannot be loaded into this model (table shapes, missing tables, sharding)."""


class UnsupportedError(DeckError, NotImplementedError):
    """The model uses a feature deck does not support yet."""


class MergeError(DeckError):
    """The merger could not build a merged checkpoint (its inputs are incompatible, missing or
    corrupt); nothing was committed and the lineage is unchanged."""


class CheckpointError(DeckError):
    """A checkpoint could not be written; nothing was committed and training may go on."""


class LeaseHeldError(DeckError):
    """Another live trainer holds the writer lease of this URI."""


class ClockSkewError(DeckError):
    """This host's clock is further from the store's than allowed: garbage collection, which
    measures ages on the store's clock, refused to delete anything."""


class SpoolError(StorageError):
    """Writing to the local staging spool failed (disk full, permissions); the checkpoint that
    needed it is not taken, committed checkpoints are untouched."""


class DoctorError(DeckError):
    """``deck doctor`` could not run the user's setup (entry point not importable, not a
    ``deck.DoctorSetup``, the user's own code raised): a usage error, not a finding about deck."""


class UnsafePathError(StorageError, CorruptCheckpointError):
    """A key of a local store leads through a symbolic link below the root, or names something
    other than a regular file (a FIFO, a device, a socket): deck never reads, writes or deletes
    through it, so a URI written by someone else cannot make it touch files outside the root or
    hang on a read. It is damage of the URI (a :class:`CorruptCheckpointError`: restores fall
    back around it) reported by the storage layer (a :class:`StorageError`)."""


class MissingDependencyError(DeckError, ImportError):
    """A package deck needs for what was asked is not installed: TorchRec's stack (torchrec,
    fbgemm-gpu or fbgemm-gpu-cpu, and TorchRec's own dependencies), which the distribution does
    not declare because TorchRec's wheel pulls the CUDA fbgemm-gpu. The message names the pip
    commands that install it."""
