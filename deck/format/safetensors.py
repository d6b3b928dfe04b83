"""Writing a safetensors file tensor by tensor (https://huggingface.co/docs/safetensors): the
header first, from the tensors' names, shapes and dtypes alone, then each tensor's bytes in the
header's order. safetensors' own writer needs every tensor in memory at once; ``deck export
--format safetensors`` and ``deck follow`` write through this instead, so they hold one table at
a time. Any safetensors reader reads the result.
"""

from __future__ import annotations

import json
import math
import struct
from typing import IO, Any

import torch

from deck.errors import UnsupportedError

# safetensors' name of each dtype deck writes.
DTYPES = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bool: "BOOL",
}

# The tensors of a safetensors file, in order: name, shape, dtype.
Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


def check_dtypes(layout: Layout) -> None:
    """Raise :class:`UnsupportedError` naming the first tensor of ``layout`` whose dtype has no
    safetensors name (before anything is written)."""
    for name, _, dtype in layout:
        if dtype not in DTYPES:
            raise UnsupportedError(f"{name}: dtype {dtype} has no safetensors name")


def preamble(metadata: dict[str, str], layout: Layout) -> bytes:
    """What a safetensors file of ``layout``'s tensors (in that order) holds before their
    data: the header's length, then the header (``metadata`` and each tensor's dtype, shape
    and place). Each dtype must be in :data:`DTYPES` (:func:`check_dtypes`)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for name, size, dtype in layout:
        n = math.prod(size) * dtype.itemsize
        header[name] = {
            "dtype": DTYPES[dtype],
            "shape": list(size),
            "data_offsets": [off, off + n],
        }
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the reference writer pads the header to 8 bytes
    return struct.pack("<Q", len(head)) + head


def write_tensor(f: IO[bytes], t: torch.Tensor) -> None:
    """Write ``t``'s data as the file's next tensor (its :func:`preamble` entry says where)."""
    # Little-endian raw bytes in C order, as safetensors stores them.
    f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
