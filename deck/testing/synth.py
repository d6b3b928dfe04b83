"""Synthetic checkpoints in the exact on-disk format, without TorchRec.

:class:`SynthTrainer` holds a small sharded "model" (plain tensors in :class:`TableShard`s, two
ranks by default: a row-wise split table, a table-wise table, a column-wise split table and a
table saved in full every time) and writes full / delta checkpoints with the real
:class:`deck.trainer.writer.RankPartWriter` and :func:`deck.trainer.writer.commit`, remembering the exact state of
every step it saved. :func:`restore_state` applies a chain with :func:`deck.read.restore.apply_chain`
into fresh tensors, so tests can compare restores bitwise with what was saved.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from deck.format.epochs import EpochWitnesses
from deck.format.manifest import CheckpointManifest, Kind
from deck.format.statefile import scalar_key
from deck.model import TableShard
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.read.restore import apply_chain, read_state_file
from deck.storage import Storage
from deck.trainer.writer import RankPartWriter, Sink, commit

State = dict[str, torch.Tensor]

# (table, num_rows, num_cols, [(rank, row_offset, rows, col_offset, cols)], full_only)
LAYOUT: list[tuple[str, int, int, list[tuple[int, int, int, int, int]], bool]] = [
    ("t0.weight", 400, 4, [(0, 0, 200, 0, 4), (1, 200, 200, 0, 4)], False),
    ("t1.weight", 300, 4, [(1, 0, 300, 0, 4)], False),
    ("t2.weight", 200, 4, [(0, 0, 200, 0, 2), (1, 0, 200, 2, 2)], False),
    ("t3.weight", 16, 2, [(0, 0, 16, 0, 2)], True),
]


def shard_key(s: TableShard) -> str:
    """The shard's name in the synthetic trainer's own state (the format's scalar key)."""
    return scalar_key(s.table, s.row_offset, s.col_offset)


def make_shards(world_size: int = 2, fill: float | None = None, seed: int = 0) -> list[TableShard]:
    """Every shard of every rank (rank = ``track_base``), random or constant values; with one
    rank, each table whole on it (as a one-rank job holds them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for table, num_rows, num_cols, places, full_only in LAYOUT:
        if world_size == 1:
            places = [(0, 0, num_rows, 0, num_cols)]
        for rank, row_off, rows, col_off, cols in places:
            if rank >= world_size:
                continue

            def t(*shape: int) -> torch.Tensor:
                if fill is not None:
                    return torch.full(shape, fill)
                return torch.randn(*shape, generator=g)

            out.append(
                TableShard(
                    table=table,
                    num_rows=num_rows,
                    num_cols=num_cols,
                    row_offset=row_off,
                    rows=rows,
                    col_offset=col_off,
                    cols=cols,
                    states={"weight": t(rows, cols), "momentum1": t(rows)},
                    full_only=full_only,
                    track_base=rank,
                )
            )
    return out


def tables() -> dict[str, tuple[int, int]]:
    return {t: (r, c) for t, r, c, _, _ in LAYOUT}


def snapshot(shards: list[TableShard]) -> State:
    return {f"{shard_key(s)}|{name}": v.clone() for s in shards for name, v in s.states.items()}


@dataclass
class Saved:
    id: str
    kind: str
    state: State
    user: int


class SynthTrainer:
    """A fake trainer writing real deck checkpoints (2 ranks, 4 tables, fused-optimizer-like
    states) with exact knowledge of every saved step."""

    def __init__(
        self,
        storage: Storage,
        world_size: int = 2,
        chunk_bytes: int = 4096,
        seed: int = 0,
        bundle_bytes: int = 0,
        id_seed: int | None = None,
    ):
        self.storage = storage
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.bundle_bytes = bundle_bytes
        self.gen = torch.Generator().manual_seed(seed)
        # Checkpoint ids: random, or from ``id_seed`` for a test that must see the same folders
        # when it replays the same saves (Hypothesis replaying a state machine's example)
        self.ids = random.Random(id_seed) if id_seed is not None else random.SystemRandom()
        self.shards = make_shards(world_size, seed=seed)
        self.touched: dict[str, set[int]] = {shard_key(s): set() for s in self.shards}
        self.parent: tuple[int, str] | None = None
        self.base: int | None = None
        self.epoch = 0
        self.step = 0
        self.saved: dict[int, Saved] = {}
        self.witnesses = EpochWitnesses(storage)  # as the trainer's committer puts them

    def train(self, steps: int = 1, rows: int = 12) -> None:
        """Change ``rows`` Zipf-ish random rows of every shard per step (like lookups + update)."""
        for _ in range(steps):
            self.step += 1
            for s in self.shards:
                n = min(rows, s.rows)
                hot = torch.randint(0, max(1, s.rows // 8), (n // 2,), generator=self.gen)
                cold = torch.randint(0, s.rows, (n - n // 2,), generator=self.gen)
                local = torch.unique(torch.cat([hot, cold]))
                for v in s.states.values():
                    v[local] = torch.randn(v[local].shape, generator=self.gen)
                self.touched[shard_key(s)].update(local.tolist())
            # full_only tables change everywhere (like weight decay), not only where touched.
            for s in self.shards:
                if s.full_only:
                    s.states["weight"].mul_(0.5)

    def save(self, kind: str = "delta") -> CheckpointManifest:
        """Write a checkpoint of the current step (a full when there is no parent yet)."""
        kind, ckpt_id = self.next_checkpoint(kind)
        step, full = self.step, kind == "full"
        for rank in range(self.world_size):
            self.write_part(rank, ckpt_id, full)
        m = commit(
            self.storage,
            step=step,
            ckpt_id=ckpt_id,
            kind=Kind.FULL if full else Kind.DELTA,
            parent=None if full else self.parent,
            base=step if full or self.base is None else self.base,
            epoch=self.epoch,
            world_size=self.world_size,
            deck_version="test",
            witnesses=self.witnesses,
        )
        self.saved_as(ckpt_id, kind)
        return m

    def save_deltas(self, count: int) -> None:
        """``count`` times: train a step, then save a delta of it."""
        for _ in range(count):
            self.train()
            self.save()

    def next_checkpoint(self, kind: str = "delta") -> tuple[str, str]:
        """The kind (a full when there is no parent yet) and a new id of the next checkpoint."""
        return ("full" if self.parent is None else kind), f"{self.ids.getrandbits(64):016x}"

    def write_part(self, rank: int, ckpt_id: str, full: bool, sink: Sink | None = None) -> None:
        """Write rank ``rank``'s part of checkpoint ``ckpt_id`` of the current step: to the
        store, or into ``sink`` (a stager's part, which then takes it there)."""
        step = self.step
        mine = [s for s in self.shards if s.track_base == rank]
        w = RankPartWriter(
            self.storage,
            step,
            ckpt_id,
            rank,
            self.world_size,
            self.chunk_bytes,
            sink=sink,
            bundle_bytes=self.bundle_bytes,
        )

        def rows_for(s: TableShard) -> torch.Tensor | None:
            if full or s.full_only:
                return None
            return torch.tensor(sorted(self.touched[shard_key(s)]), dtype=torch.int64)

        dense = {"mlp": torch.full((3,), float(step))} if rank == 0 else None
        w.write_part(mine, rows_for, dense, {"user": {"step": step, "rank": rank}})

    def saved_as(self, ckpt_id: str, kind: str) -> None:
        """The current step was saved as ``ckpt_id``: the parent of the next delta."""
        self.parent = (self.step, ckpt_id)
        if kind == "full":
            self.base = self.step
        for v in self.touched.values():
            v.clear()
        self.saved[self.step] = Saved(ckpt_id, kind, snapshot(self.shards), self.step)

    def rollback(self, step: int) -> None:
        """Continue from saved ``step`` (as a restore would): a new epoch, a new timeline."""
        saved = self.saved[step]
        for s in self.shards:
            for name, t in s.states.items():
                t.copy_(saved.state[f"{shard_key(s)}|{name}"])
        for v in self.touched.values():
            v.clear()
        self.parent = (step, saved.id)
        self.epoch += 1
        self.step = step
        # Steps after ``step`` of the old timeline are abandoned; re-saving them replaces them.
        for later in [k for k in self.saved if k > step]:
            del self.saved[later]


def saved_chain(storage: Storage, deltas: int) -> SynthTrainer:
    """A trainer that saved a full, then ``deltas`` deltas, one training step apart."""
    tr = SynthTrainer(storage)
    tr.save("full")
    for _ in range(deltas):
        tr.train()
        tr.save()
    return tr


def zero_a_chunk(storage: Storage, m: CheckpointManifest) -> None:
    """Damage checkpoint ``m`` of a local store: its first chunk file zeroed, size unchanged."""
    root = storage.local_path("")
    assert root is not None, "a local store"
    chunk = sorted(Path(root, m.folder).rglob("*.chunk"))[0]
    chunk.write_bytes(b"\0" * chunk.stat().st_size)


def restore_state(storage: Storage, chain: list[CheckpointManifest]) -> tuple[State, int]:
    """Apply ``chain`` into fresh (NaN-filled) shards; returns their state and the user step
    read from the last checkpoint's extra file."""
    shards = make_shards(2 if chain[-1].world_size >= 2 else 1, fill=float("nan"))
    _, parts = apply_chain(storage, chain, shards, tables())
    extra = read_state_file(storage, chain[-1], parts[0].extra)
    return snapshot(shards), int(extra["user"]["step"])


def restore_step(storage: Storage, step: int) -> tuple[State, int]:
    return restore_state(storage, chain_for(read_manifests(storage), step))


def same(a: State, b: State) -> list[str]:
    """Keys whose tensors differ bitwise (NaN never equals, so unrestored rows show up)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        if a[k].shape != b[k].shape or not torch.equal(
            a[k].view(torch.int32), b[k].view(torch.int32)
        ):
            bad.append(k)
    return bad
