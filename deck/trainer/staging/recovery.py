"""Restart recovery: the parts an earlier process left pending in the spool are finished by the
commit thread, or discarded when they can never commit."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

from deck.errors import CorruptCheckpointError, DeckError
from deck.format.checksum import checksum
from deck.format.manifest import (
    load_model,
    parse_step_dir,
    rank_dir,
    rank_manifest_name,
    step_dir,
)
from deck.trainer.staging.destination import Destination
from deck.trainer.staging.records import PENDING_SUFFIX, CheckpointStats, PendingPart, _Item
from deck.trainer.staging.spool import SpoolDir

if TYPE_CHECKING:
    from deck.trainer.coordination import Coordinator

logger = logging.getLogger(__package__)


def recover(
    spool: SpoolDir | None,
    dest: Destination,
    rank: int,
    coord: Coordinator | None,
    submit: Callable[[_Item], None],
) -> list[CheckpointStats]:
    """:meth:`Stager.recover <deck.trainer.staging.Stager.recover>`: find rank ``rank``'s
    pending parts in the spool, drop those another rank does not have (``coord``), and
    ``submit`` the others to the commit thread, which finishes them (or discards those it finds
    committed or useless)."""
    found = [] if spool is None else _scan_spool(spool, dest.storage.uri, rank)
    if coord is not None and coord.world_size > 1:
        found = _agree_on_pending(found, coord, spool, dest)
    out = []
    for p in sorted(found, key=lambda p: p.step):
        assert spool is not None  # found in it
        stats = CheckpointStats(step=p.step, kind=p.kind.value, id=p.ckpt_id, state="recovering")
        logger.info(
            "deck: resuming pending %s checkpoint of step %d from spool %s",
            p.kind.value,
            p.step,
            spool.root,
        )
        stats.spool_reserved = sum(spool.size(p, f) for f in p.files) if spool.scratch else 0
        spool.claim(stats.spool_reserved)
        submit(_Item(p, stats))
        out.append(stats)
    return out


def _scan_spool(spool: SpoolDir, uri: str, rank: int) -> list[PendingPart]:
    if not os.path.isdir(spool.root):
        return []
    found = []
    name = rank_manifest_name(rank).replace(".json", PENDING_SUFFIX)
    part_dir = rank_dir(rank)
    for step_name in sorted(os.listdir(spool.root)):
        step_path = os.path.join(spool.root, step_name)
        if parse_step_dir(step_name) is None or not os.path.isdir(step_path):
            continue
        for attempt in os.listdir(step_path):
            path = os.path.join(step_path, attempt, name)
            # NotADirectoryError: in the local tier the spool is the destination, whose step
            # folders also hold manifest.json (a file, not an attempt folder).
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.remove(path + ".tmp")  # a record torn by a crash: its part never staged
            p = None
            if os.path.isfile(path):
                try:
                    with open(path, "rb") as f:
                        p = load_model(PendingPart, f.read(), path)
                except (DeckError, OSError) as e:
                    logger.warning("deck: ignoring unreadable pending record %s: %s", path, e)
                    os.remove(path)
            if p is not None and p.uri == uri:
                found.append(p)
            elif spool.scratch:
                # Only a spool holds nothing but pending parts; in the local tier this folder
                # may be a committed checkpoint (GC handles attempts that never committed).
                shutil.rmtree(os.path.join(step_path, attempt, part_dir), ignore_errors=True)
    return found


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
            and not dest.exists(f"{step_dir(p.step)}/{p.ckpt_id}/{rank_manifest_name(r)}")
        ]
        if missing and dest.committed_id(p.step) != p.ckpt_id:
            assert spool is not None  # p was found in it
            logger.warning(
                "deck: discarding the spooled part of step %d (%s) in %s: rank(s) %s never "
                "staged theirs before the crash, so it cannot be committed",
                p.step,
                p.ckpt_id,
                spool.root,
                missing,
            )
            spool.remove_files(p.step, list(p.files))
            spool.remove_pending(p)
            continue
        keep.append(p)
    return keep


def check_recovered(spool: SpoolDir, p: PendingPart) -> None:
    """After a crash the spool may hold torn files: verify every one against the manifest."""
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
        try:
            with open(spool.path(p.step, rel), "rb") as f:
                data = memoryview(f.read())
        except FileNotFoundError:
            data = memoryview(b"")
        if len(data) != max(off + n for off, n, _ in ranges) or any(
            checksum(data[off : off + n]) != digest for off, n, digest in ranges
        ):
            raise CorruptCheckpointError(
                f"spooled file {spool.path(p.step, rel)} of step {p.step} is damaged; discarding it"
            )
