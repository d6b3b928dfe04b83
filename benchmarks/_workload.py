"""The Zipf DLRM workload without TorchRec, for the merger / retention benchmarks.

The demo DLRM's embedding side, reproduced with plain tensors so that hundreds of checkpoint
intervals run in minutes on a CPU box: ``tables`` tables of ``rows`` x ``dim`` fp32 with a
rowwise-adagrad ``momentum1`` (one fp32 per row), placed table-wise on ``ranks`` ranks (table i on
rank i % ranks), written through the real writer (:class:`deck.trainer.writer.RankPartWriter` and
:func:`deck.trainer.writer.commit`: same chunk files, manifests and commit order as the trainer).

Each interval is ``steps_per_delta`` training steps. A step looks up, per table,
``batch * pooling`` ids per rank drawn like ``deck.demo.make_batch``: Zipf(``zipf_a``) ranks,
folded into the table and scattered by a fixed odd multiplier. The looked-up rows get new values
(weight += noise, momentum1 += noise^2), which is all a checkpoint can see of an optimizer step.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deck.config import StagingConfig
from deck.format.manifest import CheckpointManifest, Kind, RankManifest
from deck.model import TableShard
from deck.storage import LocalStorage, Storage
from deck.trainer.staging import CheckpointStats, PendingPart, Stager
from deck.trainer.writer import RankPartWriter, commit


@dataclass
class Workload:
    tables: int = 8
    rows: int = 100_000
    dim: int = 64
    ranks: int = 2
    batch: int = 1024
    pooling: int = 2
    zipf_a: float = 1.2
    steps_per_delta: int = 10
    chunk_bytes: int = 4 * 1024 * 1024
    seed: int = 0

    def describe(self) -> str:
        return (
            f"{self.tables} tables x {self.rows} rows x {self.dim} dim fp32 + rowwise momentum, "
            f"{self.ranks} ranks, batch {self.batch}/rank, pooling {self.pooling}, "
            f"Zipf({self.zipf_a}), {self.steps_per_delta} steps per interval"
        )


def make_shards(w: Workload, fill: float | None = None) -> list[TableShard]:
    g = torch.Generator().manual_seed(w.seed)
    out = []
    for t in range(w.tables):
        if fill is None:
            weight = torch.randn(w.rows, w.dim, generator=g) * 0.01
            mom = torch.zeros(w.rows)
        else:
            weight = torch.full((w.rows, w.dim), fill)
            mom = torch.full((w.rows,), fill)
        out.append(
            TableShard.whole(
                f"sparse.ebc.t{t}.weight",
                {"weight": weight, "momentum1": mom},
                track_base=t % w.ranks,  # the rank holding it
            )
        )
    return out


def table_shapes(w: Workload) -> dict[str, tuple[int, int]]:
    return {f"sparse.ebc.t{t}.weight": (w.rows, w.dim) for t in range(w.tables)}


@dataclass
class ZipfTrainer:
    """Trains the workload and writes checkpoints of it to ``storage``."""

    w: Workload
    storage: Storage
    shards: list[TableShard] = field(init=False)
    step: int = 0
    parent: tuple[int, str] | None = None
    base: int = 0

    def __post_init__(self) -> None:
        self.shards = make_shards(self.w)
        self.rng = np.random.default_rng(self.w.seed)
        self.gen = torch.Generator().manual_seed(self.w.seed + 1)
        self.pending: list[set[int]] = [set() for _ in self.shards]

    def interval(self) -> list[torch.Tensor]:
        """Train one checkpoint interval; returns the rows touched in it, per table (sorted)."""
        w = self.w
        n = w.batch * w.pooling * w.ranks * w.steps_per_delta
        touched = []
        for i, s in enumerate(self.shards):
            ids = (self.rng.zipf(w.zipf_a, size=n) - 1) % w.rows
            ids = (ids * 0x9E3779B1) % w.rows
            rows = torch.from_numpy(np.unique(ids).astype(np.int64))
            noise = torch.randn(len(rows), w.dim, generator=self.gen) * 1e-3
            s.states["weight"].index_add_(0, rows, noise)
            s.states["momentum1"].index_add_(0, rows, noise[:, 0] ** 2)
            self.pending[i].update(rows.tolist())
            touched.append(rows)
        self.step += w.steps_per_delta
        return touched

    def save(
        self,
        kind: str = "delta",
        rows: Callable[[int, TableShard], torch.Tensor | None] | None = None,
        parent: tuple[int, str] | None = None,
        storage: Storage | None = None,
    ) -> CheckpointManifest:
        """Write a checkpoint of the current step: a full, a delta of the rows touched since the
        last checkpoint, or (``rows``) any given rows per table relative to ``parent``. Only
        checkpoints to the trainer's own storage move its parent / pending rows."""
        storage = storage or self.storage
        full = kind == "full"
        ckpt_id = secrets.token_hex(8)
        for rank in range(self.w.ranks):
            mine = [(i, s) for i, s in enumerate(self.shards) if s.track_base == rank]
            writer = RankPartWriter(
                storage, self.step, ckpt_id, rank, self.w.ranks, self.w.chunk_bytes
            )
            index = {id(s): i for i, s in mine}

            def rows_for(s: TableShard, index: dict[int, int] = index) -> torch.Tensor | None:
                if full:
                    return None
                if rows is not None:
                    return rows(index[id(s)], s)
                return torch.tensor(sorted(self.pending[index[id(s)]]), dtype=torch.int64)

            dense = {"mlp": torch.zeros(64)} if rank == 0 else None
            writer.write_part([s for _, s in mine], rows_for, dense, {"user": {"step": self.step}})
        p = parent if parent is not None else self.parent
        m = commit(
            storage,
            step=self.step,
            ckpt_id=ckpt_id,
            kind=Kind.FULL if full else Kind.DELTA,
            parent=None if full else p,
            base=self.step if full else self.base,
            epoch=0,
            world_size=self.w.ranks,
            deck_version="bench",
        )
        if rows is None and storage is self.storage:  # the trainer's own lineage
            self.parent = (self.step, ckpt_id)
            if full:
                self.base = self.step
            for p_ in self.pending:
                p_.clear()
        return m

    def live(self) -> dict[str, torch.Tensor]:
        return {f"{s.table}|{k}": v.clone() for s in self.shards for k, v in s.states.items()}


def restore_into_fresh(
    storage: Storage, chain: list[CheckpointManifest], w: Workload
) -> tuple[float, dict[str, torch.Tensor], int]:
    """Apply ``chain`` into freshly allocated tables; returns (seconds, state, bytes read)."""
    import time

    from deck.read.restore import apply_chain

    shards = make_shards(w, fill=0.0)
    t0 = time.perf_counter()
    stats, _ = apply_chain(storage, chain, shards, table_shapes(w))
    dt = time.perf_counter() - t0
    state = {f"{s.table}|{k}": v for s in shards for k, v in s.states.items()}
    return dt, state, stats.bytes


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a
    )


def tree_bytes(root: str) -> int:
    """Bytes of every file under a local directory (what the storage holds)."""
    import os

    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def in_workdir(out: str | None, prefix: str, run: Callable[[str], int]) -> int:
    """``run(work)`` in ``out`` (kept afterwards) or in a fresh temp dir (removed afterwards)."""
    work = out or tempfile.mkdtemp(prefix=prefix)
    try:
        return run(work)
    finally:
        if out is None:
            shutil.rmtree(work, ignore_errors=True)


def save_full(
    stager: Stager, storage: Storage, shards: list[TableShard], step: int, cfg: StagingConfig
) -> tuple[CheckpointStats, RankManifest]:
    """One full checkpoint of ``shards`` through ``stager``, as DeltaCheckpointer.save drives it,
    waited for until committed; its stats (``started``: the snapshot's start) and rank manifest."""
    info = PendingPart(
        uri=storage.uri,
        step=step,
        ckpt_id=f"{step + 1:016x}",
        rank=0,
        world_size=1,
        kind=Kind.FULL,
        parent=None,
        parent_id=None,
        base=step,
        epoch=0,
    )
    estimate = sum(s.rows * s.row_bytes() for s in shards)
    if not stager.reserve(estimate):
        raise RuntimeError("spool full")
    t0 = time.perf_counter()
    staged = stager.begin(info, reserved=estimate)
    writer = RankPartWriter(storage, step, info.ckpt_id, 0, 1, cfg.chunk_bytes, sink=staged)
    writer.write_part(shards, lambda s: None, {"dense.w": torch.ones(3)}, {"user": None})
    staged.wait_written()
    stats = CheckpointStats(
        step=step,
        kind="full",
        id=info.ckpt_id,
        stall_s=time.perf_counter() - t0,
        bytes=writer.bytes_written,
        rows=writer.rows_written,
        chunks=writer.chunks_written,
        started=t0,
    )
    stager.enqueue(staged, stats)
    if not stager.flush(timeout=3600):
        raise RuntimeError("stager did not finish within an hour")
    if stats.state != "committed":
        raise RuntimeError(f"checkpoint not committed: {stats.state} {stats.error}")
    assert staged.part is not None
    return stats, staged.part


def williams_order(n: int, rep: int) -> list[int]:
    """Row ``rep`` of a Williams design for ``n`` modes: over ``n`` rows (``2n`` when ``n`` is
    odd) every ordered pair of modes is adjacent equally often."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows[rep % len(rows)]


def drop_cache(paths: list[str]) -> None:
    """Evict ``paths`` from the page cache (fsynced files: their clean pages go), so the next
    read of them comes from the disk, as after a restart."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[str]) -> None:
    """Read ``paths`` whole, so the next read of them comes from the page cache."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass


class _OneTable:
    """The adapter surface ChainWriter reads: one shard, no dense state."""

    def __init__(self, shard: TableShard):
        self.shard = shard

    def table_shards(self) -> list[TableShard]:
        return [self.shard]

    def dense_state(self) -> dict[str, torch.Tensor]:
        return {}

    def dense_buffers(self) -> set[str]:
        return set()


def one_table_chain(
    weight: torch.Tensor, momentum1: torch.Tensor, root: str
) -> tuple[Any, Stager, Any, TableShard]:
    """A single-rank :class:`deck.trainer.chain.ChainWriter` (default ``StagingConfig``, local
    tier at ``root``) over one whole-table shard of ``weight`` (rows x dim) with a rowwise
    ``momentum1`` and a tracker of its rows: the trainer's real save path
    without TorchRec. Its deltas name a parent that was never committed (no full is written),
    so their commit fails in the background: callers clear ``stager.take_failure()`` and
    ``take_failed()`` after each save to keep the next one a delta. Returns (chain, stager,
    tracker, shard)."""
    from deck.trainer.chain import ChainWriter
    from deck.trainer.coordination import Coordinator
    from deck.trainer.tracker import TrackerStore

    shard = TableShard.whole("t.weight", {"weight": weight, "momentum1": momentum1})
    storage = LocalStorage(root)
    staging = StagingConfig()
    stager = Stager(storage, staging, rank=0)
    tracker = TrackerStore(shard.rows, ("checkpoint",))
    chain = ChainWriter(
        label="checkpoint",
        consumer="checkpoint",
        storage=storage,
        stager=stager,
        epoch=0,
        coord=Coordinator(),
        tracker=tracker,
        adapter=_OneTable(shard),  # type: ignore[arg-type]
        staging=staging,
        extra_state=lambda shards: {},
        parent=(0, "0" * 16),  # never committed: see the docstring
        base=0,
    )
    return chain, stager, tracker, shard


def journal_claim_times(rows: int, marked: int, repeats: int) -> tuple[list[float], int, int]:
    """Times of the tracker's usual claim (``TrackerStore.begin_read`` from its journal, and the
    sort of its rows) of
    ``marked`` random rows of a ``rows``-row tracker (two consumers), each claim aborted (which
    journals its rows again) so every repeat claims the same rows. Returns (seconds, rows claimed,
    the tracker's bytes with those rows pending: ``TrackerStore.nbytes()``)."""
    from deck.trainer.tracker import TrackerStore

    store = TrackerStore(rows, ("a", "b"))
    store.record(torch.randint(0, rows, (marked,), generator=torch.Generator().manual_seed(rows)))
    store.compact()
    held = store.nbytes()
    times, n = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tok = store.begin_read("a")
        n = tok.rows.numel()  # its sort: in the stall where the rows are copied there
        times.append(time.perf_counter() - t0)
        store.abort(tok)
    return times, n, held
