"""The stall of a delta vs rows per rank (fixed delta) and vs delta size (fixed table), one run.

One process, the trainer's real save path without TorchRec: a :class:`ChainWriter` (claim,
snapshot into the stager's buffer pool, the vote) over a tracker of ``rows`` rows and one table
shard of ``rows`` x ``--dim`` fp32 weights with a rowwise fp32 ``momentum1`` (TorchRec's
rowwise Adagrad layout), local tier under a temp dir, ``release="in_memory"``, default
``StagingConfig``. Between checkpoints, ``delta`` uniformly random rows are updated and recorded
in the tracker, as lookups would. Tables are allocated lazily (``torch.empty``), so a 256M-row
table costs only the pages the deltas touch.

Per point, ``--repeats`` deltas (the first one, which sizes the buffer pool, is dropped), each
after the background of the previous one finished; medians of: the stall (``stall_s``: dense
state, claim, snapshot, vote), the claim, the snapshot, and the baseline -- the pure gather of the
same rows (``index_select`` of every state into one preallocated buffer) -- and their ratio.

No full checkpoint is written (a full of a 256M-row table would take 17 GiB here): the deltas
name a parent that was never committed, so their commit fails in the background and each
failure flag is cleared before the next delta, which keeps every delta a delta. The stall path
is the trainer's all the same; what is measured ends before the background starts.

    python benchmarks/bench_stall_sweep.py [--repeats 7] [--dim 16]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
from _workload import one_table_chain

from deck.model import TableShard

ROWS = [1_000_000, 4_000_000, 16_000_000, 64_000_000, 256_000_000]
DELTA_AT = 80_000  # rows per delta for the rows sweep (bench_stall's delta per rank)
DELTAS = [10_000, 40_000, 160_000, 640_000]
ROWS_AT = 4_000_000  # rows per rank for the delta sweep (bench_stall's rows per rank)


def _gather(shard: TableShard, rows: torch.Tensor) -> float:
    """The floor: every state of ``rows`` index_select-ed into one preallocated warm buffer."""
    outs = [torch.empty((rows.numel(), *t.shape[1:]), dtype=t.dtype) for t in shard.states.values()]
    for o in outs:
        o.zero_()
    t0 = time.perf_counter()
    for t, o in zip(shard.states.values(), outs, strict=True):
        torch.index_select(t, 0, rows, out=o)
    return time.perf_counter() - t0


def point(rows: int, delta: int, dim: int, repeats: int, root: str) -> dict[str, float]:
    """Median stall parts of ``repeats`` deltas of ``delta`` rows over a ``rows``-row shard."""
    chain, stager, tracker, shard = one_table_chain(
        torch.empty(rows, dim, dtype=torch.float32), torch.empty(rows, dtype=torch.float32), root
    )
    g = torch.Generator().manual_seed(rows + delta)
    got: dict[str, list[float]] = {k: [] for k in ("stall", "claim", "snapshot", "gather")}
    try:
        for i in range(repeats + 1):
            ids = (
                torch.randperm(rows, generator=g)[:delta]
                if rows < 2**24
                else torch.unique(torch.randint(0, rows, (delta,), generator=g))
            )
            shard.states["weight"][ids] = float(i)  # the step's updates fault the pages in
            shard.states["momentum1"][ids] = float(i)
            tracker.record(ids)
            peek = tracker.begin_read("checkpoint")
            gather = _gather(shard, peek.rows)
            tracker.abort(peek)
            stats = chain.save("delta", step=i + 1)
            assert stats is not None and stats.kind == "delta", stats
            stager.flush()
            stager.take_failure()  # the commit failed for lack of a parent (on purpose)
            stager.take_failed()
            if i == 0:
                continue  # sized the pool
            got["stall"].append(stats.stall_s)
            got["claim"].append(stats.claim_s)
            got["snapshot"].append(stats.snapshot_s)
            got["gather"].append(gather)
    finally:
        stager.close()
    out = {k: statistics.median(v) for k, v in got.items()}
    out["ratio"] = statistics.median(
        s / g for s, g in zip(got["stall"], got["gather"], strict=True)
    )
    out["mib"] = delta * (8 + dim * 4 + 4) / 2**20
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--max-rows", type=int, default=ROWS[-1])
    a = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("deck").setLevel(logging.CRITICAL)  # the on-purpose commit failures
    torch.set_num_threads(1)
    print(
        f"one rank, one table of R rows x {a.dim} fp32 + rowwise momentum1, default "
        f"StagingConfig, local tier, medians of {a.repeats} deltas (ms); "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    head = (
        "| rows per rank | delta rows | delta MiB | stall | claim | snapshot | gather |"
        " stall / gather |\n|---|---|---|---|---|---|---|---|"
    )
    points = [(r, DELTA_AT) for r in ROWS if r <= a.max_rows]
    points += [(ROWS_AT, d) for d in DELTAS if d != DELTA_AT]
    print(head)
    for rows, delta in points:
        with tempfile.TemporaryDirectory(prefix="deck-sweep-") as root:
            r = point(rows, delta, a.dim, a.repeats, root)
        print(
            f"| {rows / 1e6:g}M | {delta} | {r['mib']:.1f} | {r['stall'] * 1e3:.2f} | "
            f"{r['claim'] * 1e3:.2f} | {r['snapshot'] * 1e3:.2f} | {r['gather'] * 1e3:.2f} | "
            f"{r['ratio']:.2f}x |",
            flush=True,
        )
    print("\nreproduce: " + " ".join([os.path.relpath(sys.executable), *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
