"""The checksum of every file deck writes: xxh3-64 over the bytes, as 16 hex digits.

Kept apart from :mod:`deck.format.chunks` (which needs torch) so that readers of manifests --
``deck ls``, the catalog, the CLI -- check records without importing torch.
"""

from __future__ import annotations

import xxhash


def checksum(data: bytes | bytearray | memoryview) -> str:
    """xxh3-64 of ``data`` as lowercase hex; the same bytes always give the same string."""
    return xxhash.xxh3_64_hexdigest(data)
