"""The records a commit writes, built one way for the trainer's rank 0 and the merger.

A commit record (``manifest.json``) lists every rank's part manifest with its size, checksum and
the bytes of the part's data files; both writers of checkpoints build it here, so the fields a
reader trusts are filled the same way whoever committed.
"""

from __future__ import annotations

import time
from typing import Any

from deck.format.checksum import checksum
from deck.format.manifest import FORMAT_VERSION, CheckpointManifest, RankManifest, RankRef
from deck.version import __version__


def rank_ref(rank: int, part: RankManifest, path: str, data: bytes) -> RankRef:
    """The commit record's reference to rank ``rank``'s part manifest ``part``, stored at
    ``path`` (relative to the checkpoint folder) as ``data``."""
    files = [c.nbytes for s in part.shards for c in s.chunks] + [part.extra.nbytes]
    if part.dense is not None:
        files.append(part.dense.nbytes)
    return RankRef(
        rank=rank, path=path, nbytes=len(data), checksum=checksum(data), data_bytes=sum(files)
    )


def commit_record(
    refs: list[RankRef], *, deck_version: str = __version__, **fields: Any
) -> CheckpointManifest:
    """The commit record over ``refs`` (one per rank, in rank order); ``fields`` are the
    checkpoint's own (id, step, kind, parent, ...). Stamps the format version, the writer's deck
    version (this one unless given) and the time; validation is the manifest model's."""
    return CheckpointManifest(
        format_version=FORMAT_VERSION,
        ranks=tuple(refs),
        created_unix=time.time(),
        deck_version=deck_version,
        **fields,
    )
