"""Reading what a URI holds: committed checkpoints, their manifests, and restore chains."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deck.chunks import checksum
from deck.errors import CheckpointNotFoundError, CorruptCheckpointError, NotFoundError
from deck.format import (
    MANIFEST,
    CheckpointManifest,
    Kind,
    RankManifest,
    load_model,
    parse_step_dir,
    step_dir,
)
from deck.storage import Storage, open_storage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as :func:`list_checkpoints` reports it."""

    step: int
    kind: str
    ranks: int
    bytes: int
    committed: bool
    parent: int | None
    base: int
    epoch: int
    id: str


def read_manifests(storage: Storage) -> dict[int, CheckpointManifest]:
    """Every committed checkpoint under ``storage`` by step. Folders without ``manifest.json``
    (in progress, failed, or crashed) are not checkpoints and are skipped."""
    out: dict[int, CheckpointManifest] = {}
    for key in storage.list(""):
        head, _, tail = key.partition("/")
        step = parse_step_dir(head)
        if step is None or tail != MANIFEST:
            continue
        where = storage.describe(key)
        m = load_model(CheckpointManifest, storage.get(key), where)
        if m.step != step:
            raise CorruptCheckpointError(
                f"{where}: manifest says step {m.step}, folder says {step}"
            )
        out[step] = m
    return out


def list_checkpoints(uri: str, storage_options: dict | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints at ``uri``, oldest step first (an empty list for an empty URI)."""
    storage = open_storage(uri, storage_options)
    return [
        CheckpointInfo(
            step=m.step,
            kind=m.kind.value,
            ranks=m.world_size,
            bytes=m.data_bytes,
            committed=True,
            parent=m.parent,
            base=m.base,
            epoch=m.epoch,
            id=m.id,
        )
        for m in sorted(read_manifests(storage).values(), key=lambda m: m.step)
    ]


def chain_for(manifests: dict[int, CheckpointManifest], step: int) -> list[CheckpointManifest]:
    """The checkpoints that reproduce ``step``: its full first, then each delta in step order.

    Follows ``parent`` links and checks each parent is the very checkpoint the delta was taken
    against (same id), so deltas of an abandoned timeline are never mixed into another.
    """
    if step not in manifests:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at step {step}; committed: {sorted(manifests)}"
        )
    chain = [manifests[step]]
    while chain[-1].kind is Kind.DELTA:
        child = chain[-1]
        parent = manifests.get(child.parent) if child.parent is not None else None
        if parent is None or parent.id != child.parent_id:
            raise CheckpointNotFoundError(
                f"step {step} cannot be restored: its chain needs checkpoint {child.parent_id} at step "
                f"{child.parent} (for delta {child.step}), which is "
                + ("missing" if parent is None else "from another timeline")
                + "; restore an older step or take a new full checkpoint"
            )
        chain.append(parent)
    return chain[::-1]


def latest_restorable(manifests: dict[int, CheckpointManifest]) -> int | None:
    """The newest checkpoint (highest epoch, then step) whose chain is complete."""
    for m in sorted(manifests.values(), key=lambda m: (m.epoch, m.step), reverse=True):
        try:
            chain_for(manifests, m.step)
        except CheckpointNotFoundError as e:
            logger.warning("skipping step %d: %s", m.step, e)
            continue
        return m.step
    return None


def read_rank_manifests(storage: Storage, m: CheckpointManifest) -> list[RankManifest]:
    """The rank parts of a committed checkpoint, each verified against the commit record."""
    out = []
    for ref in m.ranks:
        key = f"{step_dir(m.step)}/{ref.path}"
        where = storage.describe(key)
        try:
            data = storage.get(key)
        except NotFoundError:
            raise CorruptCheckpointError(
                f"{where}: rank {ref.rank} part of step {m.step} is missing"
            ) from None
        if len(data) != ref.nbytes or checksum(data) != ref.checksum:
            raise CorruptCheckpointError(
                f"{where}: rank {ref.rank} part of step {m.step} fails its checksum"
            )
        out.append(load_model(RankManifest, data, where))
    return out
