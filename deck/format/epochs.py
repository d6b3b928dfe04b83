"""Epoch witnesses: one small object per epoch, so that a reader learns the newest epoch from
one listing instead of from every commit record.

A rollback (any restore, any new session) starts a new epoch, and "the latest step" is the
newest (epoch, step): a re-saved step below the old timeline's highest one wins. A reader that
plans from the newest segments of the catalog (:mod:`deck.read.window`) or reads through the
catalog learns epochs only from the records the catalog gives, and a catalog is not trusted
(a forged one, valid checksums and wrong contents, may leave a record out). The witness of
epoch ``e``, ``_epochs/<e:020d>.json`` holding ``{"epoch": e, "step": s}``, is created by the
committing writer before the first commit record of ``e`` it writes (``s``: that record's step,
the lowest step of the epoch, since steps only go forward within one); readers list
``_epochs/`` and take the newest epoch from the names, and GC of the newest steps reads its
``step`` (:func:`witnessed_step`). Spec: docs/format.md, "Epoch witnesses".

The records stay the truth; a witness only says where to look. One naming an epoch no record
holds (a crash between the witness and its record, a witness planted by hand) makes a reader
read more, never pick another step; a store without any (written by a deck before witnesses,
or whose witnesses were removed) is read record by record where the newest epoch matters.
Writers keep the newest :data:`KEEP_WITNESSES` and delete older ones, so the listing stays a
few names however many epochs a job had.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from deck.errors import CorruptCheckpointError, NotFoundError, StorageError
from deck.storage import Storage
from deck.storage.base import get_bounded

logger = logging.getLogger(__name__)

EPOCH_ROOT = "_epochs"
# Whole names only (no trailing newline): anything else under _epochs/ is not deck's.
_WITNESS_NAME = re.compile(r"([0-9]{20})\.json")
# Epochs are counted from 0 by one per session or restore; names above this are not deck's.
MAX_EPOCH = 10**18
# Witnesses a writer keeps (the newest): readers need only the newest; a few more spare a
# reader listing while a writer creates one and deletes another from seeing neither.
KEEP_WITNESSES = 4


def witness_body(epoch: int, step: int) -> bytes:
    """What a witness holds (restores take only its name; GC reads its ``step``)."""
    return json.dumps({"epoch": epoch, "step": step}, sort_keys=True).encode()


def witness_key(epoch: int) -> str:
    """The key of the witness of ``epoch``."""
    return f"{EPOCH_ROOT}/{epoch:020d}.json"


def witnesses_in(keys: Iterable[str]) -> list[int]:
    """The epochs witnessed among ``keys`` (a listing), ascending; other keys are ignored."""
    out = []
    for key in keys:
        if not key.startswith(f"{EPOCH_ROOT}/"):
            continue
        m = _WITNESS_NAME.fullmatch(key[len(EPOCH_ROOT) + 1 :])
        if m and int(m.group(1)) <= MAX_EPOCH:
            out.append(int(m.group(1)))
    return sorted(out)


def newest_witness(storage: Storage) -> int | None:
    """The newest epoch witnessed at ``storage`` (one listing of ``_epochs/``), None when there
    is no witness. A listing that fails raises (never taken for "none")."""
    found = witnesses_in(storage.list(f"{EPOCH_ROOT}/"))
    return found[-1] if found else None


def witnessed_step(storage: Storage, epoch: int) -> int | None:
    """The step the witness of ``epoch`` says its first commit record is at (every record of
    the epoch is at or above it: steps only go forward within one); None when it is gone or
    does not say (a planted or damaged one: the caller assumes the least). A read that fails
    otherwise raises."""
    try:
        got = json.loads(get_bounded(storage, witness_key(epoch), 4096))
    except NotFoundError:
        return None
    except (CorruptCheckpointError, ValueError):
        return None
    step = got.get("step") if isinstance(got, dict) else None
    ok = got.get("epoch") == epoch and type(step) is int and 0 <= step < 10**12
    return step if ok else None


@dataclass
class EpochWitnesses:
    """One committing writer's witnesses (the trainer's rank 0, in its commit thread): the
    witness of an epoch is put before the first commit record of it this writer writes, then
    witnesses older than the newest :data:`KEEP_WITNESSES` are deleted."""

    storage: Storage
    done: set[int] = field(default_factory=set)

    def before_commit(self, epoch: int, step: int) -> None:
        """Put the witness of ``epoch`` (first committed at ``step``) unless this writer did.
        Raises when the put fails: the record must not come without it."""
        if epoch in self.done:
            return
        # (if absent: one there already, from an earlier writer of this epoch, names the
        # lower step)
        self.storage.put_if_absent(witness_key(epoch), witness_body(epoch, step))
        self.done.add(epoch)
        self._prune(epoch)

    def _prune(self, epoch: int) -> None:
        """Delete the witnesses of epochs older than the newest kept (best effort: one left
        behind costs a name in a listing)."""
        try:
            listed = witnesses_in(self.storage.list(f"{EPOCH_ROOT}/"))
            kept = sorted({*listed, epoch})[-KEEP_WITNESSES:]
            for e in listed:
                if e < kept[0]:
                    self.storage.delete(witness_key(e))
        except (StorageError, OSError) as ex:
            logger.warning(
                "deck: could not delete old epoch witnesses under %s: %s",
                self.storage.describe(EPOCH_ROOT),
                ex,
            )
