"""The cheap check of a checkpoint's files: present, with the sizes its records give (no chunk
read). Apart from :mod:`deck.read.verify` because that one decodes chunks and needs torch,
which ``deck gc`` (whose plan checks replacements this way) does not otherwise load."""

from __future__ import annotations

from collections.abc import Collection

from deck.errors import DeckError, NotFoundError
from deck.format.manifest import CheckpointManifest
from deck.read.catalog import checkpoint_label, overlapped, read_rank_manifests
from deck.storage import Storage


def check_files(
    storage: Storage, m: CheckpointManifest, listing: Collection[str] | None = None
) -> list[str]:
    """The cheap check of checkpoint ``m`` (no chunk is read): its rank manifests verify, and
    every file they name exists with its recorded size (a bundle: at least up to its last
    chunk). Returns the problems, each naming the file; never raises for damage (a storage
    error is a problem too: what cannot be checked is not intact). ``listing``: keys the
    caller listed already; a file not in it is missing without a request.
    :func:`deck.read.verify.verify_checkpoint` is the full check (every checksum)."""
    try:
        parts = read_rank_manifests(storage, m)
    except DeckError as e:
        return [str(e)]
    sizes: dict[str, tuple[int, bool]] = {}  # key -> (bytes, exact)
    for part in parts:
        part.file_sizes(m.folder, sizes)

    def size(key: str) -> int:
        if listing is not None and key not in listing:
            raise NotFoundError(storage.describe(key))
        return storage.size(key)

    problems = []
    for key, have in overlapped(storage, size, list(sizes)):  # sized concurrently when remote
        want, exact = sizes[key]
        where = f"{storage.describe(key)} ({checkpoint_label(m)})"
        if isinstance(have, NotFoundError):
            problems.append(f"{where}: file is missing")
        elif isinstance(have, DeckError):
            problems.append(f"{where}: cannot be checked ({have})")
        elif isinstance(have, Exception):
            raise have
        elif have != want if exact else have < want:
            problems.append(f"{where}: {have} bytes, its record says {want}")
    return problems
