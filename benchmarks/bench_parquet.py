"""Parquet export vs safetensors export of the same step: write throughput.

Writes one full checkpoint with the real writer and format (one rank, ``--tables`` tables of
``--rows`` x ``--dim`` fp32 + a rowwise momentum, random values), then, in rounds whose order
alternates, exports its step with ``deck.ops.export.export_safetensors`` (one file) and
``deck.ops.export.parquet.export_parquet`` (one file per table, uncompressed, the default), each into a
fresh path (removed after the round), and times each call end to end (reading the chain, building
the output, writing and fsyncing it). The first round of each warms the page cache and is not
counted. Prints the command line, each round, medians, MiB/s of table state and the ratio; checks
that the Parquet files hold the tables bitwise.

    python benchmarks/bench_parquet.py [--rows 100000] [--tables 8] [--dim 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _workload import Workload, make_shards

from deck.format.manifest import Kind
from deck.format.parquet import read_table
from deck.ops.export import StepState, export_safetensors
from deck.ops.export.parquet import export_parquet
from deck.storage import LocalStorage
from deck.trainer.writer import RankPartWriter, commit


def _write(storage: LocalStorage, w: Workload) -> dict[str, dict[str, torch.Tensor]]:
    """A one-rank full of step 0; returns its tables' states."""
    shards = make_shards(w)
    g = torch.Generator().manual_seed(1)
    for s in shards:  # a trained-looking momentum, not zeros
        s.states["momentum1"].copy_(torch.rand(s.rows, generator=g))
    ckpt_id = secrets.token_hex(8)
    writer = RankPartWriter(storage, 0, ckpt_id, 0, 1, w.chunk_bytes)
    writer.write_part(shards, lambda s: None, {"dense.w": torch.ones(3)}, {"scalars": {}})
    commit(
        storage,
        step=0,
        ckpt_id=ckpt_id,
        kind=Kind.FULL,
        parent=None,
        base=0,
        epoch=0,
        world_size=1,
        deck_version="bench",
    )
    return {s.table: s.states for s in shards}


def _check(out: str, saved: dict[str, dict[str, torch.Tensor]]) -> None:
    for table, states in saved.items():
        _, cols = read_table(os.path.join(out, f"{table}.parquet"))
        for name, want in states.items():
            if not torch.equal(cols[name].view(torch.uint8), want.view(torch.uint8)):
                raise SystemExit(f"{table} {name}: the Parquet file differs from the checkpoint")


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)  # like each rank of the demo (a 2-core shared box)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    print("command: python " + " ".join([sys.argv[0], *sys.argv[1:]]), flush=True)
    w = Workload(tables=a.tables, rows=a.rows, dim=a.dim, ranks=1)
    work = tempfile.mkdtemp(prefix="deck-bench-parquet-")
    try:
        storage = LocalStorage(os.path.join(work, "ck"))
        saved = _write(storage, w)
        table_bytes = sum(t.numel() * t.element_size() for s in saved.values() for t in s.values())
        print(
            f"workload: {w.describe().split(', ')[0]}, one rank, one full; "
            f"{table_bytes / 2**20:.0f} MiB of table state; {a.repeats} rounds + 1 warm-up",
            flush=True,
        )
        exports = {
            "safetensors": lambda st, out: export_safetensors(st, out + ".safetensors"),
            "parquet": export_parquet,
        }
        times: dict[str, list[float]] = {k: [] for k in exports}
        sizes: dict[str, int] = {}
        for r in range(a.repeats + 1):
            order = list(exports) if r % 2 == 0 else list(reversed(exports))
            for name in order:
                out = os.path.join(work, f"{name}-{r}")
                state = StepState(storage, 0)
                t0 = time.perf_counter()
                exports[name](state, out)
                dt = time.perf_counter() - t0
                if name == "parquet":
                    _check(out, saved)
                    sizes[name] = sum(e.stat().st_size for e in os.scandir(out))
                    shutil.rmtree(out)
                else:
                    sizes[name] = os.path.getsize(out + ".safetensors")
                    os.remove(out + ".safetensors")
                if r:
                    times[name].append(dt)
                print(
                    f"  round {r}{' (warm-up)' if not r else ''} {name:11s} {dt:6.3f} s", flush=True
                )
        print()
        print("| export | output | median | min | MiB/s of table state (median) |")
        print("|---|---|---|---|---|")
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, ts in times.items():
            print(
                f"| {name} | {sizes[name] / 2**20:.0f} MiB | {med[name]:.3f} s | {min(ts):.3f} s | "
                f"{table_bytes / 2**20 / med[name]:,.0f} |"
            )
        print(f"parquet / safetensors time: {med['parquet'] / med['safetensors']:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
