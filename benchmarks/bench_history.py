"""Point queries over history (``deck history``): chunks read vs chunks present per row.

Writes a history of the Zipf DLRM workload (benchmarks/_workload.py: real writer and format; a
full, then a delta per interval, the default merger after every interval, everything kept), then
asks :func:`deck.ops.history.row_history` for rows of table 0 from the hottest (Zipf rank 0) to cold
ones, reporting chunks read vs chunks of that table in the chains of every step (what restoring
every step would read of it), the skips by id range and by bloom filter, and the bloom
filters' share of the rank manifests.

    python benchmarks/bench_history.py [--intervals 40] [--rows 100000] [--dim 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _workload import Workload, ZipfTrainer, tree_bytes

from deck.merge.policy import MergeConfig
from deck.merge.worker import MergeWorker
from deck.ops.history import row_history
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.storage import LocalStorage, open_storage


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--intervals", type=int, default=40)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--chunk-kib", type=int, default=256)
    a = p.parse_args(argv)
    w = Workload(
        tables=a.tables, rows=a.rows, dim=a.dim, steps_per_delta=1, chunk_bytes=a.chunk_kib << 10
    )
    with tempfile.TemporaryDirectory() as work:
        uri = os.path.join(work, "deck")
        storage = LocalStorage(uri)
        tr = ZipfTrainer(w, storage)
        tr.save("full")
        worker = MergeWorker(storage, MergeConfig())
        t0 = time.perf_counter()
        for _ in range(a.intervals):
            tr.interval()
            tr.save()
            worker.run_once()
        ms = read_manifests(storage)
        bloom = manifest = chunks = 0
        for m in [*ms.values(), *ms.merged.values()]:
            for ref, part in zip(m.ranks, read_rank_manifests(storage, m), strict=True):
                manifest += ref.nbytes
                for rec in part.shards:
                    chunks += len(rec.chunks)
                    bloom += sum(len(c.index.bloom or "") for c in rec.chunks if c.index)
        print(
            f"workload: {w.describe()}; {a.intervals} intervals, chunks of {a.chunk_kib} KiB, "
            f"default merger; {len(ms)} trainer + {len(ms.merged)} merger checkpoints, "
            f"{chunks} chunks, {tree_bytes(uri) / 2**20:.0f} MiB ({time.perf_counter() - t0:.0f} s)"
        )
        print(
            f"bloom filters: {bloom / 2**10:.0f} KiB of {manifest / 2**10:.0f} KiB of rank "
            "manifests (base64)"
        )
        table = tr.shards[0].table
        print(
            "| row (Zipf rank) | steps | chunks present | read | skipped: range | bloom | "
            "false pos. | time |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for rank in (0, 1, 10, 100, 1000, 10_000, a.rows - 1):
            row = rank * 0x9E3779B1 % a.rows
            t1 = time.perf_counter()
            h = row_history(open_storage(uri), table, row)
            dt = time.perf_counter() - t1
            print(
                f"| {row} ({rank}) | {len(h.steps)} | {h.chunks_present} | **{h.chunks_read}** | "
                f"{h.skipped_range} | {h.skipped_bloom} | {h.false_positives} | {dt:.2f} s |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
