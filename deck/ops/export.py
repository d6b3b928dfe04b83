"""Export the full state of one step to standard formats: a torch.distributed.checkpoint (DCP)
directory that ``dcp.load`` restores into a freshly built DMP model, or one safetensors file of
unsharded tensors for inspection.

The state of step N is what ``DeltaCheckpointer.restore(N)`` loads: the rows of its cheapest
chain (full, then deltas / merged deltas, newest row wins; :func:`deck.read.restore.apply_chain` does
the applying, with every chunk checksum-verified), the dense state and the dense optimizer state
of the trainer checkpoint of N.

**Names.** Tensors get the names a DCP save of this state dict of the live model would give::

    {"model": model.state_dict(),
     "optim": CombinedOptimizer([model.fused_optimizer, dense_optimizer]).state_dict()}

i.e. ``model.<state_dict key>`` for tables, dense parameters and buffers, and
``optim.state.<param key>.<state>`` for the fused table states (``<table key>.<table name>.
momentum1``, laid out as TorchRec's fused optimizer lays them out: a row-wise state of a
column-sharded table has one block of rows per column shard, in column order) and for the dense
optimizer's (a TorchRec ``KeyedOptimizer``: keyed by parameter name). A dense optimizer whose
state is not keyed by parameter name (a plain ``torch.optim`` one) is left out and reported, as
are non-tensor values and the user's own state (neither can be written without pickle on our
side).

**Memory.** Tables are read and written one *table shard* at a time (every state of one
column/row shard, e.g. 2 x 1M x 64 floats for rowwise Adagrad): the DCP export holds at most the
largest shard plus the dense state; the safetensors export holds the largest *table* (its
tensors must be contiguous) plus the dense state. Each table shard is written to its own
``.distcp`` file, so DCP's writer never holds more than that either.

DCP's own format pickles its ``.metadata`` file and ``torch.save``-s each tensor (its reader
uses ``weights_only`` loading); deck writes it through DCP's writer and never reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from deck.adapters.base import TableShard
from deck.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    UnsupportedError,
)
from deck.format.chunks import DTYPES
from deck.format.manifest import CheckpointManifest, ChunkRecord, RankManifest, ShardRecord
from deck.read.catalog import describe, read_manifests, read_rank_manifests
from deck.read.lineage import build_graph, chain_bytes, cheapest_chain
from deck.read.restore import apply_chain, part_where, read_state_file
from deck.read.verify import check_files
from deck.storage import Storage, open_storage
from deck.storage.atomic import atomic_file

logger = logging.getLogger(__name__)

Progress = Callable[[int], None]
_SAFETENSORS_DTYPES = {
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


@dataclass(frozen=True)
class ShardGeometry:
    """Where a table shard sits in its table: rows ``[row_offset, +rows)`` and columns
    ``[col_offset, +cols)`` of a ``num_rows x num_cols`` table."""

    table: str
    num_rows: int
    num_cols: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int

    def table_shard(self, states: dict[str, torch.Tensor]) -> TableShard:
        """A :class:`TableShard` at this place holding ``states`` (what ``apply_chain`` fills)."""
        return TableShard(**geometry_of(self), states=states)


def geometry_of(shard: Any) -> dict[str, Any]:
    """The :class:`ShardGeometry` fields of any shard-like object (a ``ShardRecord`` of a
    manifest, a ``TableShard``, a geometry)."""
    return {f.name: getattr(shard, f.name) for f in dataclasses.fields(ShardGeometry)}


@dataclass(frozen=True)
class ShardSpec(ShardGeometry):
    """One table shard of the exported step, and the dtype / row shape of each of its states."""

    rank: int
    states: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]

    @property
    def nbytes(self) -> int:
        return sum(
            self.rows * math.prod(shape) * torch.empty((), dtype=dt).element_size()
            for _, dt, shape in self.states
        )


@dataclass(frozen=True)
class Piece:
    """Where one state of one shard goes: tensor ``fqn`` (global ``size``), block at
    ``offsets`` of shape ``sizes``. ``path`` is the fqn's place in the nested state dict."""

    fqn: str
    path: tuple[str, ...]
    state: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    shard: int  # index into StepState.shards


@dataclass
class ExportReport:
    """What an export wrote."""

    step: int
    chain: list[str]  # folders of the checkpoints applied, oldest first
    path: str
    tensors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    max_held_bytes: int = 0  # largest block of table state held at once
    skipped: list[str] = field(default_factory=list)


def table_name(table: str) -> str:
    """The table's name inside its module (what TorchRec's fused optimizer keys states by) from
    its state_dict key ``<module path>.embedding_bags.<name>.weight``."""
    parts = table.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        raise UnsupportedError(f"table key {table!r} does not end in '<name>.weight'")
    return parts[-2]


# A state of one shard: its name, dtype and whether it is row-wise (one value per row).
_StateKind = tuple[str, torch.dtype, bool]


def _chain_of(storage: Storage, step: int | None) -> tuple[int, list[CheckpointManifest]]:
    """``step`` (None: the latest restorable) and its cheapest chain, oldest first."""
    manifests = read_manifests(storage)
    if not manifests:
        raise CheckpointNotFoundError(f"no committed checkpoints at {storage.uri}")
    graph = build_graph(manifests, storage.uri)
    chosen = graph.latest() if step is None else step
    if chosen is None:
        raise CheckpointNotFoundError(f"no restorable step at {storage.uri}")
    return chosen, cheapest_chain(graph, chosen)


def _kinds_of(rec: ShardRecord) -> tuple[_StateKind, ...]:
    """The states of a shard record, as its first chunk holds them."""
    specs = []
    for seg in rec.chunks[0].segments:
        if seg.name not in rec.states:
            continue  # row ids, a quantised state's per-row scale
        if tuple(seg.shape[1:]) not in ((), (rec.cols,)):
            raise UnsupportedError(
                f"table {rec.table}: state {seg.name} has rows of shape "
                f"{tuple(seg.shape[1:])}, which export cannot lay out"
            )
        dtype = seg.source_dtype or seg.dtype  # a quantised state's real dtype
        specs.append((seg.name, _dtype(dtype, rec.table), len(seg.shape) == 1))
    return tuple(specs)


class StepState:
    """The state of one committed step of a URI, readable table shard by table shard.

    Opening it reads the commit records and the rank manifests of the chain (small files); the
    tables are read by :meth:`read_shard`, the dense state by :meth:`eager_state`.
    """

    def __init__(
        self,
        uri: str,
        step: int | None = None,
        storage_options: dict[str, Any] | None = None,
        allow_quantized: bool = False,
        storage: Storage | None = None,
    ):
        # A chain with quantised weights (deck.format.quantize) is refused unless allowed: its tables
        # are then the dequantised values, not the exact state.
        self.allow_quantized = allow_quantized
        # The store itself, not a wrapper: chunk reads take its own fast paths (memory-mapped
        # files of a LocalStorage, overlapped gets of a remote one).
        # (``storage``: a view given by the caller, e.g. the Kafka loader's stream overlay.)
        self.storage: Storage = storage or open_storage(uri, storage_options)
        self.step: int
        self.chain: list[CheckpointManifest]
        self.step, self.chain = _chain_of(self.storage, step)
        self.last = self.chain[-1]
        # Exporting shard by shard applies the chain once per shard: its rank manifests are
        # read (and checksum-verified) once, here.
        self.rank_parts: dict[str, list[RankManifest]] = {
            m.folder: read_rank_manifests(self.storage, m) for m in self.chain
        }
        self.parts: list[RankManifest] = self.rank_parts[self.last.folder]
        self.read_bytes = chain_bytes(self.chain)
        ranked = sorted(self.parts, key=lambda p: p.rank)
        self.tables: dict[str, tuple[int, int]] = {
            rec.table: (rec.num_rows, rec.num_cols) for part in ranked for rec in part.shards
        }
        self.shards: list[ShardSpec] = self._shard_specs(ranked, self._state_kinds())
        self.pieces: list[Piece] = [p for i in range(len(self.shards)) for p in self._pieces(i)]
        self._check_cover()
        self._check_claims()

    # ---- layout ------------------------------------------------------------------------------
    def _state_kinds(self) -> dict[str, tuple[_StateKind, ...]]:
        """State names and dtypes per table, from the first chunk of the chain that has them. A
        state's rows are either one value (row-wise) or the shard's columns (point-wise), so the
        shapes follow the exported layout even where the chain's checkpoints were written with
        another column split (a restore into another plan, then deltas)."""
        kinds: dict[str, tuple[_StateKind, ...]] = {}
        for m in self.chain:
            for part in self.rank_parts[m.folder]:
                for rec in part.shards:
                    if rec.table not in kinds and rec.chunks:
                        kinds[rec.table] = _kinds_of(rec)
        return kinds

    def _shard_specs(
        self, ranked: list[RankManifest], kinds: dict[str, tuple[_StateKind, ...]]
    ) -> list[ShardSpec]:
        """Every table shard of the step's rank parts (``ranked``: by rank), in table, column,
        row order."""
        shards = []
        for part in ranked:
            for rec in part.shards:
                if rec.table not in kinds:
                    raise CheckpointNotFoundError(
                        f"table {rec.table}: no chunk in the chain of step {self.step} at {self.storage.uri} "
                        "says what its states are"
                    )
                states = tuple(
                    (n, dt, () if rowwise else (rec.cols,)) for n, dt, rowwise in kinds[rec.table]
                )
                shards.append(ShardSpec(**geometry_of(rec), rank=part.rank, states=states))
        shards.sort(key=lambda s: (s.table, s.col_offset, s.row_offset))
        return shards

    def _pieces(self, i: int) -> list[Piece]:
        s = self.shards[i]
        same = [t for t in self.shards if t.table == s.table]
        col_sharded = any(t.cols != t.num_cols for t in same)
        row_sharded = any(t.rows != t.num_rows for t in same)
        name = table_name(s.table)
        out = []
        for state, dtype, row_shape in s.states:
            path: tuple[str, ...]
            if state == "weight":
                fqn, path = f"model.{s.table}", ("model", s.table)
            else:
                key = f"{name}.{state}"
                fqn, path = f"optim.state.{s.table}.{key}", ("optim", "state", s.table, key)
            if row_shape == (s.cols,):  # weight, or a pointwise state: the weight's layout
                size: tuple[int, ...] = (s.num_rows, s.num_cols)
                offsets: tuple[int, ...] = (s.row_offset, s.col_offset)
                sizes: tuple[int, ...] = (s.rows, s.cols)
            elif row_shape == ():
                # TorchRec's row-wise optimizer state: a column-sharded table gets one block of
                # num_rows per column shard, in column order (batched_embedding_kernel.py,
                # get_optimizer_rowwise_shard_metadata_and_global_metadata).
                if col_sharded and row_sharded:
                    raise UnsupportedError(
                        f"table {s.table} is sharded by rows and columns (grid sharding): the "
                        "layout of its row-wise optimizer state is not supported by export"
                    )
                if col_sharded:
                    order = sorted({t.col_offset for t in same})
                    size = (s.num_rows * len(order),)
                    offsets = (order.index(s.col_offset) * s.rows,)
                else:
                    size, offsets = (s.num_rows,), (s.row_offset,)
                sizes = (s.rows,)
            else:
                raise UnsupportedError(
                    f"table {s.table}: state {state} has rows of shape {row_shape}, which "
                    "export does not know how to lay out"
                )
            out.append(Piece(fqn, path, state, size, offsets, sizes, dtype, i))
        return out

    def _check_cover(self) -> None:
        """Every exported tensor is covered exactly once by its pieces (shards never overlap)."""
        volume: dict[str, int] = {}
        size: dict[str, tuple[int, ...]] = {}
        for p in self.pieces:
            if size.setdefault(p.fqn, p.size) != p.size:
                raise UnsupportedError(f"{p.fqn}: shards disagree on its size")
            volume[p.fqn] = volume.get(p.fqn, 0) + math.prod(p.sizes)
        bad = [f for f in volume if volume[f] != math.prod(size[f])]
        if bad:
            raise UnsupportedError(
                f"step {self.step}: the shards of {bad[:3]} do not cover each table exactly once"
            )

    def _check_claims(self) -> None:
        """Before anything is allocated: the tables of this step, as its records claim them
        (rows x columns x dtype of every state), fit in what the chain's full holds (a full
        holds every row; a chunk decodes to at most its recorded bytes, times the widening of
        a quantised state). Above :data:`_CHECK_FILES_ABOVE` bytes the full's files must also
        have their recorded sizes (one size request per file), so that no record, however
        forged, makes an export or ``deck follow`` allocate more than the files hold. Raises
        :class:`CorruptCheckpointError` naming the records."""
        full = self.chain[0]
        held: dict[str, int] = {}
        for part in self.rank_parts[full.folder]:
            for rec in part.shards:
                held[rec.table] = held.get(rec.table, 0) + sum(map(_decoded_bytes, rec.chunks))
        claims: dict[str, int] = {}
        for s in self.shards:
            claims[s.table] = claims.get(s.table, 0) + s.nbytes
        for table, claim in sorted(claims.items()):
            if claim > held.get(table, 0):
                rank = next(p.rank for p in self.parts for r in p.shards if r.table == table)
                raise CorruptCheckpointError(
                    f"{part_where(self.storage, self.last, rank)}: table {table} claims "
                    f"{claim} bytes of state, but the chunks of its full ({describe(full)}) hold "
                    f"at most {held.get(table, 0)}; the records are damaged or were not written "
                    "by deck: run deck verify"
                )
        if sum(claims.values()) > _CHECK_FILES_ABOVE:
            problems = check_files(self.storage, full)
            if problems:
                raise CorruptCheckpointError(
                    f"step {self.step} at {self.storage.uri} claims {sum(claims.values())} bytes "
                    f"of tables, but its full's files do not match their records: {problems[0]}"
                    + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                )

    # ---- data --------------------------------------------------------------------------------
    def read_shard(self, i: int) -> dict[str, torch.Tensor]:
        """Every state of shard ``i`` at this step (rows of the whole chain applied)."""
        s = self.shards[i]
        shard = s.table_shard(
            {n: torch.zeros((s.rows, *shape), dtype=dt) for n, dt, shape in s.states}
        )
        apply_chain(
            self.storage,
            self.chain,
            [shard],
            self.tables,
            allow_quantized=self.allow_quantized,
            rank_parts=self.rank_parts,
        )
        return shard.states

    def eager_state(self, skipped: list[str] | None = None) -> dict[str, Any]:
        """The nested state dict of everything but the tables: ``{"model": dense state,
        "optim": {"state": dense optimizer states and per-shard scalar states}}``. What cannot be
        exported is described in ``skipped``."""
        return eager_state(self.storage, self.last, self.parts, skipped)


def eager_state(
    storage: Storage,
    last: CheckpointManifest,
    parts: list[RankManifest],
    skipped: list[str] | None = None,
) -> dict[str, Any]:
    """:meth:`StepState.eager_state` of checkpoint ``last`` (its rank manifests ``parts``):
    reads only its dense and extra files, never the tables."""
    skipped = skipped if skipped is not None else []
    model = _dense_model(storage, last, parts[0], skipped)
    extra = read_state_file(storage, last, parts[0].extra)
    opt_state = _dense_optimizer_state(extra, skipped)
    _add_scalar_states(opt_state, storage, last, parts, extra)
    if extra.get("user") is not None:
        skipped.append("user state (read it with DeltaCheckpointer.restore)")
    return {"model": model, "optim": {"state": opt_state}}


def _dense_model(
    storage: Storage, last: CheckpointManifest, rank0: RankManifest, skipped: list[str]
) -> dict[str, torch.Tensor]:
    """The tensors of the dense state (rank 0's part holds it)."""
    where = describe(last)
    if rank0.dense is None:
        skipped.append(f"{where}: rank 0 part has no dense state")
        return {}
    dense = read_state_file(storage, last, rank0.dense)
    return {k: v for k, v in dense.items() if isinstance(v, torch.Tensor)}


def _dense_optimizer_state(
    extra: dict[str, Any], skipped: list[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """The tensor states of the dense optimizers saved in rank 0's extra file, by parameter
    name."""
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    for name, saved in sorted(extra.get("optimizers", {}).items()):
        state = saved.get("state_dict", {}).get("state", {})
        if not all(isinstance(k, str) for k in state):
            skipped.append(
                f"dense optimizer {name}: its state is keyed by parameter index, not name "
                "(a plain torch.optim optimizer); wrap it in torchrec's KeyedOptimizerWrapper"
            )
            continue
        for param, values in state.items():
            for k, v in values.items():
                if isinstance(v, torch.Tensor):
                    opt_state.setdefault(param, {})[k] = v
                else:
                    skipped.append(f"dense optimizer {name}: {param}.{k} is not a tensor")
    return opt_state


def _add_scalar_states(
    opt_state: dict[str, dict[str, torch.Tensor]],
    storage: Storage,
    last: CheckpointManifest,
    parts: list[RankManifest],
    extra: dict[str, Any],
) -> None:
    """Add the fused optimizers' per-shard scalar states (every rank's extra file; ``extra`` is
    rank 0's) to ``opt_state``, one tensor per table and state."""
    scalars: dict[str, dict[str, list[tuple[tuple[int, int], torch.Tensor]]]] = {}
    for part in parts:
        ex = extra if part.rank == 0 else read_state_file(storage, last, part.extra)
        for key, values in ex.get("scalars", {}).items():
            table, row_off, col_off = key.rsplit("|", 2)
            for k, v in values.items():
                scalars.setdefault(table, {}).setdefault(k, []).append(
                    ((int(row_off), int(col_off)), v.reshape(1))
                )
    for table, per_name in scalars.items():
        for k, blocks in per_name.items():
            # TorchRec: one value per shard, in the table's shard order.
            opt_state.setdefault(table, {})[f"{table_name(table)}.{k}"] = torch.cat(
                [v for _, v in sorted(blocks, key=lambda b: b[0])]
            )


# Claims of tables larger than this are checked against the sizes of the full's files too
# (StepState._check_claims): below it, a forged claim can cost at most this much memory.
_CHECK_FILES_ABOVE = 64 * 2**20


def _decoded_bytes(c: ChunkRecord) -> int:
    """The most bytes chunk ``c`` can decode to: its recorded size, times how much wider a
    quantised segment's source dtype is than what is stored (int8 -> float32: 4)."""
    widen = 1
    for seg in c.segments:
        if seg.source_dtype is not None and seg.dtype in DTYPES and seg.source_dtype in DTYPES:
            widen = max(widen, DTYPES[seg.source_dtype].itemsize // DTYPES[seg.dtype].itemsize)
    return c.nbytes * widen


def _dtype(name: str, table: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedError(f"table {table}: unknown dtype {name!r}") from None


def flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": x}}`` -> ``{"a.b": x}``: DCP's names for a nested state dict."""
    out: dict[str, Any] = {}
    for k, v in nested.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{name}."))
        else:
            out[name] = v
    return out


def _nbytes(p: Piece | torch.Tensor) -> int:
    if isinstance(p, torch.Tensor):
        return p.numel() * p.element_size()
    return math.prod(p.size) * torch.empty((), dtype=p.dtype).element_size()


class _ExportRun:
    """One export being written: its :class:`ExportReport`, the step's dense state, and the
    caller's progress, told the bytes of each table tensor as it is written (the dense state,
    small and written in one go, is not counted in progress)."""

    def __init__(self, state: StepState, path: str, progress: Progress | None):
        self.state = state
        self.progress = progress
        self.report = ExportReport(
            step=state.step, chain=[m.folder for m in state.chain], path=path
        )
        self.eager = state.eager_state(self.report.skipped)
        self.dense = flatten(self.eager)

    def holding(self, tensors: dict[str, torch.Tensor]) -> None:
        """Record that ``tensors`` of table state are held at once (``max_held_bytes``)."""
        held = sum(_nbytes(t) for t in tensors.values())
        self.report.max_held_bytes = max(self.report.max_held_bytes, held)

    def wrote(self, t: torch.Tensor) -> None:
        """Record that table tensor ``t`` is written: its bytes, and progress."""
        self.report.bytes_written += _nbytes(t)
        if self.progress:
            self.progress(_nbytes(t))

    def finish(self) -> ExportReport:
        """The report, once every table tensor and the dense state are written."""
        self.report.tensors = len(self.dense) + len({p.fqn for p in self.state.pieces})
        self.report.bytes_written += sum(_nbytes(t) for t in self.dense.values())
        self.report.bytes_read = self.state.read_bytes
        return self.report


# ---- DCP ---------------------------------------------------------------------------------------

_PieceKey = tuple[str, tuple[int, ...]]  # (fqn, offsets): what a DCP write item names


def export_dcp(state: StepState, out_dir: str, progress: Progress | None = None) -> ExportReport:
    """Write ``state`` as a DCP checkpoint in ``out_dir`` (which must be empty or absent).

    Guarantee: ``dcp.load({"model": model.state_dict(), "optim": CombinedOptimizer([
    model.fused_optimizer, dense_opt]).state_dict()}, checkpoint_id=out_dir)`` into a model
    built with the same tables and plan fills it with exactly (bitwise) what
    ``DeltaCheckpointer.restore(step)`` loads (tables and fused optimizer states, dense
    parameters and buffers, dense optimizer state). ``.metadata`` is written last; a crash
    leaves no loadable checkpoint.
    """
    from torch.distributed.checkpoint import save as dcp_save

    _check_out_dir(out_dir)
    run = _ExportRun(state, out_dir, progress)
    by_key = {(p.fqn, p.offsets): p for p in state.pieces}
    writer = _dcp_writer(out_dir, by_key)
    with warnings.catch_warnings():
        # DCP warns that no process group is initialised: one process writing is the point.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp_save(run.eager, storage_writer=writer, planner=_dcp_planner(run, by_key), no_dist=True)
    return run.finish()


def _piece_of(by_key: dict[_PieceKey, Piece], item: Any) -> Piece | None:
    """The table piece DCP write item ``item`` stands for; None for an item of the dense state."""
    off = item.index.offset
    return by_key.get((item.index.fqn, tuple(int(x) for x in off) if off is not None else ()))


def _shard_write_items(pieces: list[Piece]) -> list[Any]:
    """One DCP SHARD write item per table piece."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    return [
        WriteItem(
            index=MetadataIndex(p.fqn, p.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(
                    offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes)
                ),
                properties=TensorProperties(dtype=p.dtype),
                size=torch.Size(p.size),
            ),
        )
        for p in pieces
    ]


class _HeldShard:
    """The one table shard a DCP export holds. The writer asks for the pieces of one shard
    together (one file per shard), so a piece of another shard drops this one and reads that."""

    def __init__(self, run: _ExportRun):
        self.run = run
        self.current: tuple[int, dict[str, torch.Tensor]] | None = None

    def tensor(self, piece: Piece) -> torch.Tensor:
        """The data of ``piece``, counted as written."""
        if self.current is None or self.current[0] != piece.shard:
            self.current = None  # drop the previous shard before reading the next
            self.current = (piece.shard, self.run.state.read_shard(piece.shard))
            self.run.holding(self.current[1])
        t = self.current[1][piece.state]
        self.run.wrote(t)
        return t


def _dcp_planner(run: _ExportRun, by_key: dict[_PieceKey, Piece]) -> Any:
    """The default planner for the dense state, plus one SHARD item per table piece whose data
    is read from the checkpoint only when the writer asks for it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem

    pieces = run.state.pieces
    held = _HeldShard(run)

    class Planner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            items = _shard_write_items(pieces)
            mappings = {**(plan.planner_data or {}), **{p.fqn: p.path for p in pieces}}
            self.plan = dataclasses.replace(
                plan, items=[*plan.items, *items], planner_data=mappings
            )
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> Any:
            piece = _piece_of(by_key, write_item)
            if piece is None:
                return super().resolve_data(write_item)
            return held.tensor(piece)

    return Planner()


def _dcp_writer(out_dir: str, by_key: dict[_PieceKey, Piece]) -> Any:
    """DCP's file writer, with one file per table shard (in plan order) and one for the rest:
    its writer keeps every tensor of a file until the file is done, so files are the unit of
    memory."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem

    class Writer(FileSystemWriter):
        def write_data(self, plan: SavePlan, planner: Any) -> Any:
            groups: dict[object, list[WriteItem]] = {}
            for item in plan.items:
                piece = _piece_of(by_key, item)
                groups.setdefault("dense" if piece is None else piece.shard, []).append(item)
            files: queue.Queue = queue.Queue()
            for n, items in enumerate(groups.values()):
                name = f"{plan.storage_data.prefix}{n}{DEFAULT_SUFFIX}"
                files.put((self.fs.concat_path(self.path, name), name, items))
            return self._write_data(planner, files)

    return Writer(out_dir, thread_count=1, per_thread_copy_ahead=0, overwrite=False)


def _check_out_dir(out_dir: str) -> None:
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConfigError(
            f"--out {out_dir} exists and is not an empty directory; choose a new or empty directory"
        )


# ---- safetensors -------------------------------------------------------------------------------

# The tensors of a safetensors file, in order: name, shape, dtype.
_Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


def export_safetensors(
    state: StepState, out_path: str, progress: Progress | None = None
) -> ExportReport:
    """Write ``state`` as one safetensors file of unsharded tensors (same names as the DCP
    export; a column-sharded table's row-wise optimizer state in TorchRec's layout), for
    inspection with any safetensors reader.

    Streams table by table: the header is computed from the manifests first, then each table
    is assembled from its shards and written (safetensors' own writer needs every tensor in
    memory at once, hence this writer of its documented format). The file appears atomically
    (written under a temporary name, then renamed).
    """
    if os.path.exists(out_path):
        raise ConfigError(f"--out {out_path} exists; choose a new file name or remove it")
    run = _ExportRun(state, out_path, progress)
    first: dict[str, Piece] = {}
    for p in state.pieces:
        first.setdefault(p.fqn, p)
    # Layout: tables in order, then the dense tensors.
    layout: _Layout = [(f, p.size, p.dtype) for f, p in first.items()]
    layout += [(k, tuple(v.shape), v.dtype) for k, v in run.dense.items()]
    for name, _, dtype in layout:
        if dtype not in _SAFETENSORS_DTYPES:
            raise UnsupportedError(f"{name}: dtype {dtype} has no safetensors name")
    metadata = {
        "format": "deck-export",
        "uri": state.storage.uri,
        "step": str(state.step),
        "chain": json.dumps(run.report.chain),
    }
    preamble = _safetensors_preamble(metadata, layout)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with atomic_file(out_path) as f:
        f.write(preamble)
        _write_tables(f, run, list(first))
        for v in run.dense.values():
            _write_tensor(f, v)
    return run.finish()


def _safetensors_preamble(metadata: dict[str, str], layout: _Layout) -> bytes:
    """What a safetensors file of ``layout``'s tensors (in that order) holds before their
    data: the header's length, then the header (``metadata`` and each tensor's dtype, shape
    and place)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for name, size, dtype in layout:
        n = math.prod(size) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(size),
            "data_offsets": [off, off + n],
        }
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the reference writer pads the header to 8 bytes
    return struct.pack("<Q", len(head)) + head


def _write_tables(f: IO[bytes], run: _ExportRun, fqns: list[str]) -> None:
    """Write the table tensors named ``fqns``, in that order, assembling one table at a time."""
    tables: dict[str, list[int]] = {}
    for i, s in enumerate(run.state.shards):
        tables.setdefault(s.table, []).append(i)
    for shard_ids in tables.values():
        full = _assemble(run.state, shard_ids)
        run.holding(full)
        for fqn in [f for f in fqns if f in full]:
            _write_tensor(f, full[fqn])
            run.wrote(full[fqn])
        del full  # before the next table is assembled: at most one table is held


def _assemble(state: StepState, shard_ids: list[int]) -> dict[str, torch.Tensor]:
    """The unsharded tensors of one table, from its shards ``shard_ids``."""
    full: dict[str, torch.Tensor] = {}
    for i in shard_ids:
        data = state.read_shard(i)
        for p in state.pieces:
            if p.shard != i:
                continue
            t = full.setdefault(p.fqn, torch.empty(p.size, dtype=p.dtype))
            block = t[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.sizes, strict=True))]
            block.copy_(data[p.state])
        del data  # before the next shard is read
    return full


def _write_tensor(f: Any, t: torch.Tensor) -> None:
    # Little-endian raw bytes in C order, as safetensors stores them.
    f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
