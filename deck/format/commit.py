"""The records a commit writes, built one way for the trainer's rank 0 and the merger.

A commit record (``manifest.json``) lists every rank's part manifest with its size, checksum and
the bytes of the part's data files; both writers of checkpoints build it here, so the fields a
reader trusts are filled the same way whoever committed.
"""

from __future__ import annotations

import time
from typing import Any

from deck.errors import NotFoundError
from deck.format.checksum import checksum
from deck.format.manifest import FORMAT_VERSION, CheckpointManifest, RankManifest, RankRef
from deck.format.stream import is_stream_file
from deck.storage import Storage
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


def first_missing_file(
    storage: Storage, folder: str, parts: list[tuple[RankRef, RankManifest]], sizes: bool
) -> str | None:
    """What is wrong with the files a commit over ``parts`` would name in ``folder``, right
    before its record is written: the first file missing (one listing of the folder) or, with
    ``sizes``, shorter or longer than its record says (a size request per file); None when all
    are there. A writer checks this because something else may delete in a folder that has no
    commit record yet (a GC run that judged it abandoned), and a record naming missing files
    would be a committed checkpoint that cannot be restored."""
    want: dict[str, tuple[int, bool]] = {}  # key -> (size, exact); at least, in a bundle
    for ref, part in parts:
        want[f"{folder}/{ref.path}"] = (ref.nbytes, True)
        part.file_sizes(folder, want)
    if not storage.lists_table_files:  # they are in a stream, not in the folder
        want = {k: v for k, v in want.items() if not is_stream_file(k)}
    listed = set(storage.list(f"{folder}/"))
    for key in sorted(want):
        if key not in listed:
            return f"{key} is missing"
        if not sizes:
            continue
        need, exact = want[key]
        try:
            have = storage.size(key)
        except NotFoundError:
            return f"{key} is missing"
        if have != need if exact else have < need:
            return f"{key} has {have} bytes, its record says {need}"
    return None
