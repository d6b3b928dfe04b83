"""Restart recovery: the parts an earlier process left pending in the spool are finished by the
commit thread, or discarded when they can never commit."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from deck.errors import CorruptCheckpointError, DeckError, NotFoundError
from deck.failpoints import failpoint
from deck.format.checksum import checksum
from deck.format.manifest import (
    load_model,
    parse_step_dir,
    rank_dir,
    rank_manifest_name,
    step_dir,
)
from deck.format.pending import PendingPart, pending_name
from deck.storage.base import get_bounded
from deck.storage.local import LocalStorage
from deck.trainer.staging.destination import Destination
from deck.trainer.staging.records import CheckpointStats, PartProgress
from deck.trainer.staging.spool import SpoolDir

if TYPE_CHECKING:
    from deck.trainer.coordination import Coordinator

logger = logging.getLogger(__package__)


def recover(
    spool: SpoolDir | None,
    dest: Destination,
    rank: int,
    coord: Coordinator | None,
    submit: Callable[[PendingPart, PartProgress, int], None],
    newest_epoch: int | None = None,
) -> list[CheckpointStats]:
    """:meth:`Stager.recover <deck.trainer.staging.Stager.recover>`: find rank ``rank``'s
    pending parts in the spool, drop those of an epoch older than ``newest_epoch`` (the newest
    committed or witnessed at the URI: a newer timeline was written since, which committing
    them would replace) and those another rank does not have (``coord``; a rank of another
    world size included), and ``submit`` the others to the commit thread
    (:meth:`Committer.submit <deck.trainer.staging.committer.Committer.submit>`: the part, its
    progress, the spool space it holds), which finishes them (or discards those it finds
    committed or useless)."""
    found = [] if spool is None else _scan_spool(spool, dest.uri, rank)
    if newest_epoch is not None:
        found = [p for p in found if not _superseded(p, newest_epoch, spool)]
    if coord is not None:  # (on one rank too: a part of a larger world waits for no one)
        found = _agree_on_pending(found, coord, spool, dest)
    out = []
    for p in sorted(found, key=lambda p: p.step):
        assert spool is not None  # found in it
        stats = CheckpointStats(step=p.step, kind=p.kind.value, id=p.ckpt_id)
        stats.progress.advance("recovering")
        logger.info(
            "deck: resuming pending %s checkpoint of step %d from spool %s",
            p.kind.value,
            p.step,
            spool.root,
        )
        reserved = sum(spool.size(p, f) for f in p.files) if spool.scratch else 0
        spool.claim(reserved)
        submit(p, stats.progress, reserved)
        out.append(stats)
    return out


def _superseded(p: PendingPart, newest_epoch: int, spool: SpoolDir | None) -> bool:
    """Whether ``p`` is of an epoch older than the newest at its URI, and then discarded: a
    later job restored and wrote a newer timeline there (from another spool, or on another
    world size), and committing this part now would replace that timeline's checkpoint of its
    step, breaking every step after it."""
    if p.epoch >= newest_epoch:
        return False
    assert spool is not None  # p was found in it
    _discard(
        spool,
        p,
        f"a newer timeline (epoch {newest_epoch}) was written at the URI since; committing it "
        f"(epoch {p.epoch}) would replace that timeline's step {p.step}",
    )
    return True


def _discard(spool: SpoolDir, p: PendingPart, why: str) -> None:
    logger.warning(
        "deck: discarding the spooled part of step %d (%s) in %s: %s",
        p.step,
        p.ckpt_id,
        spool.root,
        why,
    )
    spool.remove_files(p.step, list(p.files))
    spool.remove_pending(p)


def _scan_spool(spool: SpoolDir, uri: str, rank: int) -> list[PendingPart]:
    """Rank ``rank``'s readable pending records of ``uri`` in the spool. Everything goes through
    ``spool.store``: a link in the spool (in the local tier: the URI) is never followed, and a
    record is read (bounded) and validated before a restart acts on the files it names."""
    failpoint("stager.recover.scan", spool.root)  # test hook: the spool cannot be read (enospc)
    store = spool.store
    found = []
    name = pending_name(rank)
    part_dir = rank_dir(rank)
    for step_name in store.list_dir(""):
        step = parse_step_dir(step_name.rstrip("/"))
        if step is None or not step_name.endswith("/"):
            continue
        # Only folders: in the local tier the spool is the destination, whose step folders
        # also hold manifest.json.
        for attempt in (a for a in store.list_dir(step_name) if a.endswith("/")):
            key = f"{step_name}{attempt}{name}"
            with contextlib.suppress(OSError):
                store.delete(key + ".tmp")  # a record torn by a crash: its part never staged
            p = None
            if store.exists(key):
                try:
                    p = _read_pending(store, key, step, attempt.rstrip("/"), rank)
                except (DeckError, OSError) as e:
                    logger.warning("deck: ignoring unreadable pending record %s: %s", key, e)
                    with contextlib.suppress(OSError):
                        store.delete(key)
            if p is not None and p.uri == uri:
                found.append(p)
            elif spool.scratch:
                # Only a spool holds nothing but pending parts; in the local tier this folder
                # may be a committed checkpoint (GC handles attempts that never committed).
                with contextlib.suppress(OSError):
                    store.delete_prefix(f"{step_name}{attempt}{part_dir}/")
    return found


def _read_pending(store: LocalStorage, key: str, step: int, ckpt_id: str, rank: int) -> PendingPart:
    """The pending record at ``key``, validated (:class:`PendingPart`) and checked to be the
    record its place names; :class:`CorruptCheckpointError` naming it otherwise."""
    where = store.describe(key)
    p = load_model(PendingPart, get_bounded(store, key), where)
    if (p.step, p.ckpt_id, p.rank) != (step, ckpt_id, rank):
        raise CorruptCheckpointError(
            f"{where}: the record is of step {p.step}, checkpoint {p.ckpt_id}, rank {p.rank}, "
            "not of the folder it is in; it was not written there by deck"
        )
    return p


def _agree_on_pending(
    found: list[PendingPart], coord: Coordinator, spool: SpoolDir | None, dest: Destination
) -> list[PendingPart]:
    """Keep the parts every other rank also has pending, or has already uploaded."""
    n = int(coord.gather([float(len(found))])[:, 0].max())
    mine = [v for p in found for v in (float(p.step), float(int(p.ckpt_id, 16)))]
    rows = coord.gather(mine + [-1.0] * (2 * n - len(mine))) if n else None
    keep = []
    for p in found:
        have = {
            r
            for r in range(coord.world_size)
            if rows is not None
            and any(
                rows[r, 2 * i] == p.step and rows[r, 2 * i + 1] == int(p.ckpt_id, 16)
                for i in range(n)
            )
        }
        missing = [
            r
            for r in range(p.world_size)
            if r not in have
            and not dest.patient_exists(f"{step_dir(p.step)}/{p.ckpt_id}/{rank_manifest_name(r)}")
        ]
        if missing and dest.patient_committed_id(p.step) != p.ckpt_id:
            assert spool is not None  # p was found in it
            # (said apart: a break-it finding blamed a part staged whole on a rank the job,
            # started again on fewer ranks, no longer has)
            gone = [r for r in missing if r >= coord.world_size]
            unstaged = [r for r in missing if r < coord.world_size]
            why = []
            if gone:
                why.append(
                    f"rank(s) {gone} are not in this job of {coord.world_size} (another world "
                    "size finishes only the parts every old rank had already uploaded)"
                )
            if unstaged:
                why.append(f"rank(s) {unstaged} never staged theirs before the crash")
            _discard(
                spool,
                p,
                f"{' and '.join(why)} (of its {p.world_size}), so it cannot be committed",
            )
            continue
        keep.append(p)
    return keep


def check_recovered(spool: SpoolDir, p: PendingPart) -> None:
    """After a crash the spool may hold torn files: verify every file of ``p`` in ``spool``
    against its rank manifest (every checksummed range, and nothing past the end); raises
    :class:`CorruptCheckpointError` naming the first damaged one."""
    assert p.part is not None
    # Per file, the (offset, nbytes, checksum) ranges it must hold: the whole file, or each
    # chunk of a bundle (which then ends where its last chunk ends).
    expected: dict[str, list[tuple[int, int, str]]] = {}
    for s in p.part.shards:
        for c in s.chunks:
            expected.setdefault(c.path, []).append((c.offset or 0, c.nbytes, c.checksum))
    for fr in (p.part.extra, p.part.dense):
        if fr is not None:
            expected[fr.path] = [(0, fr.nbytes, fr.checksum)]
    for rel, ranges in expected.items():
        size = max(off + n for off, n, _ in ranges)
        try:
            # Never more than one byte past what the manifest says: only a regular file, read
            # without following links (UnsafePathError is damage too).
            data = memoryview(spool.store.get(spool.key(p.step, rel), 0, size + 1))
        except (NotFoundError, CorruptCheckpointError):
            data = memoryview(b"")
        if len(data) != size or any(
            checksum(data[off : off + n]) != digest for off, n, digest in ranges
        ):
            raise CorruptCheckpointError(
                f"spooled file {spool.path(p.step, rel)} of step {p.step} is damaged; discarding it"
            )
