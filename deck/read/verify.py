"""Re-reading a checkpoint and checking every checksum."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from deck.errors import DeckError
from deck.format.checksum import checksum
from deck.format.chunks import decode_chunk, read_chunks
from deck.format.manifest import CheckpointManifest
from deck.read.catalog import describe, read_rank_manifests
from deck.storage import Storage


@dataclass
class VerifyReport:
    """Result of verifying one checkpoint: files checked and the problems found (file + cause)."""

    step: int
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)


def verify_checkpoint(
    storage: Storage, m: CheckpointManifest, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    """Read every file of checkpoint ``m`` and check sizes and checksums; never raises for
    corruption, it reports it (naming the file)."""
    report = VerifyReport(step=m.step)
    try:
        parts = read_rank_manifests(storage, m)
    except DeckError as e:
        report.problems.append(str(e))
        return report
    root = m.folder
    for part in parts:
        for rec in part.shards:
            index = {id(c): i for i, c in enumerate(rec.chunks)}
            # One group per file: a chunk file, or the run of chunks sharing a bundle.
            for _path, group in itertools.groupby(rec.chunks, key=lambda c: c.path):
                chunks = list(group)
                seen = 0
                try:
                    for c, at, data in read_chunks(storage, root, chunks):
                        seen += 1
                        where = f"{at} (table {rec.table}, chunk {index[id(c)]}, {describe(m)})"
                        try:
                            # Checks checksums and layout only: quantised chunks are valid ones.
                            decode_chunk(data, c, where, allow_quantized=True)
                            report.bytes += len(data)
                        except DeckError as e:
                            report.problems.append(str(e))
                        if progress:
                            progress(c.nbytes)
                except DeckError as e:
                    report.problems.append(str(e))
                    if progress:
                        progress(sum(c.nbytes for c in chunks[seen:]))
                report.files += 1
        for f in (part.dense, part.extra):
            if f is None:
                continue
            key = f"{root}/{f.path}"
            try:
                data = storage.get(key)
                if len(data) != f.nbytes or checksum(data) != f.checksum:
                    report.problems.append(
                        f"{storage.describe(key)}: size or checksum mismatch ({describe(m)})"
                    )
                report.bytes += len(data)
            except DeckError as e:
                report.problems.append(str(e))
            report.files += 1
    return report
