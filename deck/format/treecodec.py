"""Nested Python state (dicts, lists, tensors, numbers) <-> bytes, without pickle.

Tensors go into a safetensors body; the structure goes into its metadata as JSON with small
markers for tensors, tuples, bytes and non-string dict keys. Decoding only ever builds those
types, so a file from an untrusted place can fail but cannot execute code.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deck.errors import CorruptCheckpointError, UnsupportedError
from deck.format.jsonio import depth_exceeds, load_json

_META_KEY = "deck_tree"
# How deep the JSON structure of a state file may nest (a tuple adds two levels, a dict with
# non-string keys three). Both sides enforce it: encode refuses a deeper state (it could not be
# restored), decode refuses a deeper file without recursing into it.
MAX_TREE_DEPTH = 100


@dataclass(frozen=True)
class CapturedTree:
    """A state tree taken apart by :func:`capture`: its structure (JSON-ready) and private copies
    of its tensors, so it can be encoded later (off the training thread) whatever happens to the
    live state meanwhile."""

    tree: Any
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (the encoded file adds its JSON header)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def encode(self) -> bytes:
        """The state file's bytes (what :func:`decode` reads): a safetensors file whose metadata
        holds the tree; the same bytes every time for the same tree."""
        metadata = {_META_KEY: json.dumps(self.tree)}
        if any(t.dtype not in _SAFETENSORS_DTYPES for t in self.tensors.values()):
            return st_save(self.tensors, metadata=metadata)  # its error names the dtype
        return _safetensors_bytes(self.tensors, metadata)


# The dtypes written without safetensors' own ``save``, by their names in its format, in the
# order of its ``Dtype`` enum: it writes the tensors of the dtype last in it first (the enum
# runs from narrow to wide, so each tensor starts aligned).
_SAFETENSORS_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
_DTYPE_RANK = {dtype: i for i, dtype in enumerate(_SAFETENSORS_DTYPES)}


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors file of ``tensors`` (CPU, contiguous, each its own storage: what
    :func:`capture` keeps): an 8-byte header length, the JSON header padded to 8 bytes, the
    tensors' bytes back to back, in safetensors' own order (by dtype, wider first, then by name:
    every tensor is aligned with no gap; the header lists them in that order).

    Why not ``safetensors.torch.save``: its Python spends ~20-60 us per tensor (ctypes casts,
    shared-storage checks) on the spool writer, holding the GIL the training thread waits for
    after every delta, and a dense model with Adam has hundreds of tensors. This builds the
    same bytes (the tests compare them and read them back with safetensors) in one join."""
    order = sorted(tensors.items(), key=lambda kv: (-_DTYPE_RANK[kv[1].dtype], kv[0]))
    header: dict[str, Any] = {"__metadata__": metadata}
    parts: list[memoryview] = []
    at = 0
    for name, t in order:
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + t.nbytes],
        }
        # numpy has no bfloat16: its bytes through a view of the same width
        parts.append((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().data)
        at += t.nbytes
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    return b"".join((struct.pack("<Q", len(head)), head, *parts))


def encode(obj: Any, what: str) -> bytes:
    """Serialise ``obj``; ``what`` names it in errors (e.g. "user state").

    Supported leaves: tensors, int, float, bool, str, bytes, None. Containers: dict, list, tuple.
    """
    return capture(obj, what).encode()


def capture(obj: Any, what: str) -> CapturedTree:
    """Copy ``obj`` for :func:`encode` (same rules and errors, raised here): its tensors are
    cloned, so the result does not change when the live state does."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_TREE_DEPTH:  # each container is at least one JSON level
            raise _too_deep(what, path)
        depth += 1
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
                raise UnsupportedError(
                    f"{what}: {path} is a {type(x).__name__}; only plain tensors can be saved here "
                    "(sharded tables must use TorchRec's fused optimizer)"
                )
            if x.layout != torch.strided:
                raise UnsupportedError(
                    f"{what}: {path} is a {x.layout} tensor; only dense tensors can be saved "
                    "here (convert it with .to_dense())"
                )
            key = f"t{len(tensors)}"
            # safetensors refuses shared storage: clone so each entry owns its bytes (one
            # contiguous copy; this runs in the checkpoint stall, once per tensor).
            t = x.detach()
            tensors[key] = (t if t.device.type == "cpu" else t.cpu()).clone(
                memory_format=torch.contiguous_format
            )
            return {"__tensor__": key}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, bytes):
            return {"__bytes__": base64.b64encode(x).decode()}
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v, f"{path}[{i}]", depth) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{path}[{i}]", depth) for i, v in enumerate(x)]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: walk(v, f"{path}.{k}", depth) for k, v in x.items()}
            return {
                "__dict__": [
                    [walk(k, path, depth), walk(v, f"{path}.{k}", depth)] for k, v in x.items()
                ]
            }
        raise UnsupportedError(
            f"{what}: {path} has type {type(x).__name__}, which deck cannot save without pickle; "
            "convert it to tensors, numbers, strings, lists or dicts"
        )

    try:
        tree = _walk_fast(obj, tensors, 0)
    except _Unsupported:
        tensors.clear()
        tree = walk(obj, what)  # raises, naming the path
    if depth_exceeds(tree, MAX_TREE_DEPTH):
        raise _too_deep(what, what)
    return CapturedTree(tree, tensors)


class _Unsupported(Exception):
    """Something :func:`capture`'s fast walk does not take: the walk that names paths runs."""


def _walk_fast(x: Any, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    """:func:`capture`'s walk without the paths its errors name (it runs in every checkpoint
    stall: building every node's path cost more than the walk). Same result; raises
    :class:`_Unsupported` wherever that walk raises."""
    if depth > MAX_TREE_DEPTH:
        raise _Unsupported
    depth += 1
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or (
            type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter)
        ):
            raise _Unsupported
        key = f"t{len(tensors)}"
        t = x.detach()
        tensors[key] = (t if t.device.type == "cpu" else t.cpu()).clone(
            memory_format=torch.contiguous_format
        )
        return {"__tensor__": key}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, bytes):
        return {"__bytes__": base64.b64encode(x).decode()}
    # Leaves inline (most nodes are numbers): a call per node is most of the walk's cost
    if isinstance(x, tuple):
        return {
            "__tuple__": [v if type(v) in _LEAVES else _walk_fast(v, tensors, depth) for v in x]
        }
    if isinstance(x, list):
        return [v if type(v) in _LEAVES else _walk_fast(v, tensors, depth) for v in x]
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if type(k) is not str or k.startswith("__"):
                raise _Unsupported  # keys the JSON tree tags: the walk that names paths does it
            out[k] = v if type(v) in _LEAVES else _walk_fast(v, tensors, depth)
        return out
    raise _Unsupported


_LEAVES = frozenset({type(None), bool, int, float, str})


def _too_deep(what: str, path: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what}: {path} nests containers deeper than deck stores ({MAX_TREE_DEPTH} JSON levels; "
        "a tuple counts 2, a dict with non-string keys 3); flatten it"
    )


def decode(data: bytes, where: str, expect: type | None = None) -> Any:
    """Inverse of :func:`encode`. Guarantees: the result is built only of the types encode
    stores, nested at most :data:`MAX_TREE_DEPTH` JSON levels, and is an instance of ``expect``
    when given (e.g. ``dict``: what the caller indexes by key); anything else raises
    :class:`CorruptCheckpointError` naming ``where`` (never a RecursionError or TypeError)."""
    try:
        (hlen,) = struct.unpack("<Q", data[:8])
        header = load_json(data[8 : 8 + hlen], where, "safetensors header")
        tree = load_json(header["__metadata__"][_META_KEY], where, "state tree", MAX_TREE_DEPTH)
        tensors = st_load(data)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # any parse failure of an untrusted file is corruption
        raise CorruptCheckpointError(f"{where}: not a valid deck state file ({e})") from None

    def build(x: Any) -> Any:
        if isinstance(x, list):
            return [build(v) for v in x]
        if isinstance(x, dict):
            if "__tensor__" in x:
                try:
                    return tensors[x["__tensor__"]]
                except (KeyError, TypeError):
                    raise CorruptCheckpointError(
                        f"{where}: missing tensor {x['__tensor__']!r}"
                    ) from None
            if "__tuple__" in x:
                return tuple(build(v) for v in x["__tuple__"])
            if "__bytes__" in x:
                return base64.b64decode(x["__bytes__"])
            if "__dict__" in x:
                return {_hashable(build(k)): build(v) for k, v in x["__dict__"]}
            return {k: build(v) for k, v in x.items()}
        return x

    def _hashable(k: Any) -> Any:
        if isinstance(k, (list, dict)):
            raise CorruptCheckpointError(f"{where}: unhashable dict key")
        return k

    try:
        out = build(tree)
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: malformed state tree ({e})") from None
    if expect is not None and not isinstance(out, expect):
        raise CorruptCheckpointError(
            f"{where}: state tree is a {type(out).__name__}, not a {expect.__name__}; the file "
            "is damaged or was not written by deck"
        )
    return out
