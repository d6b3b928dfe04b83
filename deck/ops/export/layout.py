"""The layout model of an export: which table shards a committed step has, where each state of
each shard goes in the exported tensors (:class:`Piece`), and the checks that the records claim
no more than the files hold; :class:`StepState` reads the step shard by shard."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from deck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    UnsupportedError,
)
from deck.format.chunks import DTYPES
from deck.format.manifest import (
    CheckpointManifest,
    ChunkRecord,
    RankManifest,
    ShardRecord,
    as_step,
    steps_text,
)
from deck.model import TableShard
from deck.ops.export.dense import eager_state, table_name
from deck.read.catalog import (
    checkpoint_label,
    damaged_records,
    part_where,
    read_manifests,
    read_rank_manifests,
)
from deck.read.lineage import (
    build_graph,
    chain_bytes,
    cheapest_chain,
    confirmed,
    latest_checked,
    latest_confirmed,
)
from deck.read.restore import apply_chain
from deck.read.verify import check_files, table_problems, uncommitted_meanwhile
from deck.storage import Storage


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
        return sum(self.rows * math.prod(shape) * dt.itemsize for _, dt, shape in self.states)


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


# A state of one shard: its name, dtype and whether it is row-wise (one value per row).
_StateKind = tuple[str, torch.dtype, bool]


def _chain_of(storage: Storage, step: int | None) -> tuple[int, list[CheckpointManifest]]:
    """``step`` (None: the latest restorable) and its cheapest chain, oldest first.

    A damaged commit record is damage, not absence, as for a restore: a
    :class:`CorruptCheckpointError` naming the file when it is the record of ``step``, of a
    step its chain needs, or (``step`` None) of a step newer than the latest restorable one
    (the newest step cannot be told: an older one is exported only when asked for by number).
    """
    # What is exported comes from the records, not a catalog's copy (as for a restore).
    if step is None:
        manifests, chosen = latest_confirmed(storage, read_manifests(storage))
    else:
        manifests, chosen = confirmed(storage, read_manifests(storage), step), step
    graph = build_graph(manifests, storage.uri)
    if not manifests and not manifests.damaged:
        raise CheckpointNotFoundError(f"no committed checkpoints at {storage.uri}")
    skipped = damaged_records(manifests, chosen, latest=step is None)
    if skipped:
        other = (
            f"; the newest readable step is {chosen}: export it by number (`deck export --step {chosen}`), or repair the record"
            if chosen is not None and step is None
            else f"; repair it, or export another step (committed: {steps_text(manifests, step)})"
        )
        raise CorruptCheckpointError(f"{storage.uri}: {skipped}{other}")
    if step is None:
        # What a plain restore refuses to take for the latest, an export does not take either
        # (a break-it finding: it exported an older step with a warning, exit 0)
        check = latest_checked(storage, manifests, chosen)
        if check.gives_up is not None:
            newest = check.step
            instead = f" (step {newest} is the newest before it)" if newest is not None else ""
            # (no quarantine is advised: nothing may be damaged, a record is missing)
            raise CorruptCheckpointError(
                f"{check.gives_up}; export a step by number (`deck export --step N`){instead}; "
                f"`deck verify {storage.uri} --all` reports every step it found so"
            )
    if chosen is None:
        raise CheckpointNotFoundError(f"no restorable step at {storage.uri}")
    try:
        return chosen, cheapest_chain(graph, chosen)
    except CheckpointNotFoundError:
        node = graph.trainer.get(chosen)
        while node is not None and node.start is not None:
            parent = node.start[0]
            if parent in manifests.damaged:
                raise CorruptCheckpointError(
                    f"step {chosen} cannot be exported: its chain needs step {parent}, whose "
                    f"commit record is damaged ({manifests.damaged[parent]})"
                ) from None
            node = graph.trainer.get(parent)
        raise


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
        storage: Storage,
        step: int | None = None,
        allow_quantized: bool = False,
        chain: list[CheckpointManifest] | None = None,
    ):
        # A chain with quantised weights (deck.format.quantize) is refused unless allowed: its tables
        # are then the dequantised values, not the exact state.
        self.allow_quantized = allow_quantized
        # The store itself, not a wrapper: chunk reads take its own fast paths (memory-mapped
        # files of a LocalStorage, overlapped gets of a remote one).
        # (Or a view given by the caller, e.g. the Kafka loader's stream overlay.)
        self.storage = storage
        self.step: int
        self.chain: list[CheckpointManifest]
        # (``chain``: ``step``'s, as a caller that just read and checked the records chose it)
        if chain is not None and step is not None:
            self.step, self.chain = step, chain
        else:  # (a step no folder name holds is refused here, as deck.load refuses it)
            self.step, self.chain = _chain_of(
                self.storage, None if step is None else as_step(step, "export")
            )
        self.last = self.chain[-1]
        # Exporting shard by shard applies the chain once per shard: its rank manifests are
        # read (and checksum-verified) once, here.
        self.rank_parts: dict[str, list[RankManifest]] = {
            m.folder: read_rank_manifests(self.storage, m) for m in self.chain
        }
        self.parts: list[RankManifest] = self.rank_parts[self.last.folder]
        self._check_tables()
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

    def _full_files(self, full: CheckpointManifest) -> list[str]:
        """:func:`check_files` of the chain's full: the damage found; a file it could not read
        raises :class:`StorageError` (a read error is not damage)."""
        unreadable: list[str] = []
        held = self.rank_parts[full.folder]
        problems = check_files(self.storage, full, parts=held, unreadable=unreadable)
        if unreadable:
            raise StorageError(f"{unreadable[0]}: a read error, not damage; export it again")
        return problems

    def _check_tables(self) -> None:
        """The chain's records name one shape per table, the full covers its tables, and each
        later checkpoint names only the full's tables, with their shapes (what a restore
        checks; a break-it finding: a forged shape was refused as an unclear usage error)."""
        full = self.chain[0]
        tables = None
        for m in self.chain:
            parts = self.rank_parts[m.folder]
            problems = table_problems(self.storage, m, parts, tables)
            if problems and m is not full:
                # The full may be the damaged one (its records all forged alike): its files
                # are named first, as verify names them
                problems = self._full_files(full) or problems
            if problems:
                raise CorruptCheckpointError(f"{problems[0]}: run deck verify")
            if tables is None:
                tables = {r.table: (r.num_rows, r.num_cols) for p in parts for r in p.shards}

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
                    f"{claim} bytes of state, but the chunks of its full "
                    f"({checkpoint_label(full)}) hold "
                    f"at most {held.get(table, 0)}; the records are damaged or were not written "
                    "by deck: run deck verify"
                )
        if sum(claims.values()) > _CHECK_FILES_ABOVE:
            problems = self._full_files(full)
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
        try:
            apply_chain(
                self.storage,
                self.chain,
                [shard],
                self.tables,
                allow_quantized=self.allow_quantized,
                rank_parts=self.rank_parts,
            )
        except CorruptCheckpointError as e:
            # GC deleted it (or a rollback's save replaced it) under this export: not damage
            # (a break-it finding: said as damage, "next: deck verify --quarantine")
            gone = next((m for m in self.chain if uncommitted_meanwhile(self.storage, m)), None)
            if gone is None:
                raise
            raise CheckpointNotFoundError(
                f"step {self.step} at {self.storage.uri}: checkpoint {gone.id} ({gone.folder}) "
                f"was deleted or replaced while it was exported (a `deck gc` with a short grace "
                f"period?): {e}; export a step the retention policy keeps"
            ) from None
        return shard.states

    def eager_state(self, skipped: list[str] | None = None) -> dict[str, Any]:
        """The nested state dict of everything but the tables: ``{"model": dense state,
        "optim": {"state": dense optimizer states and per-shard scalar states}}``. What cannot be
        exported is described in ``skipped``."""
        return eager_state(self.storage, self.last, self.parts, skipped)


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
