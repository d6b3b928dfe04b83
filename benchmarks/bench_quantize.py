"""Quantised deltas (Check-N-Run): bytes saved and error vs the exact value, per encoding.

Trains the Zipf DLRM workload (benchmarks/_workload.py: the demo's embedding side as plain
tensors) for some intervals, then writes the same delta (rows touched in the last interval) with
the real writer exact and as fp16 / bf16 / int8, reads every chunk back (checksum-verified,
dequantised: :func:`deck.format.chunks.decode_chunk`) and compares the weights with the exact ones.
``--weights heavy`` replaces the workload's weights by heavy-tailed ones (log-normal per-row
magnitude, 0.1% of values 50x larger), closer to trained embeddings and the worst case of a
per-row int8 scale. Optimizer state (rowwise momentum) stays exact in every encoding.

    python benchmarks/bench_quantize.py [--intervals 10] [--rows 100000] [--dim 64] [--weights both]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _workload import Workload, ZipfTrainer

from deck.format.chunks import decode_chunk
from deck.format.manifest import RankManifest
from deck.storage import LocalStorage
from deck.trainer.writer import RankPartWriter

ENCODINGS: list[str | None] = [None, "fp16", "bf16", "int8"]


def heavy_tailed(w: Workload, trainer: ZipfTrainer) -> None:
    g = torch.Generator().manual_seed(7)
    for s in trainer.shards:
        x = s.states["weight"]
        mag = torch.exp(torch.randn(x.shape[0], 1, generator=g))  # per-row scale, log-normal
        x.copy_(torch.randn(x.shape, generator=g) * 0.05 * mag)
        spike = torch.rand(x.shape, generator=g) < 1e-3
        x[spike] *= 50


def write_delta(
    root: str, trainer: ZipfTrainer, rows: list[torch.Tensor], enc: str | None
) -> tuple[list[RankManifest], float, LocalStorage]:
    storage = LocalStorage(os.path.join(root, enc or "exact"))
    parts = []
    t0 = time.perf_counter()
    for rank in range(trainer.w.ranks):
        mine = [(i, s) for i, s in enumerate(trainer.shards) if s.track_base == rank]
        writer = RankPartWriter(
            storage, 1, f"{rank:016x}", rank, trainer.w.ranks, trainer.w.chunk_bytes, quantize=enc
        )
        index = {id(s): i for i, s in mine}
        parts.append(
            writer.write_part(
                [s for _, s in mine], lambda s, ix=index: rows[ix[id(s)]], None, {"user": {}}
            )
        )
    return parts, time.perf_counter() - t0, storage


def errors(
    storage: LocalStorage, parts: list[RankManifest], trainer: ZipfTrainer
) -> tuple[float, float, float, float, int]:
    """(max abs err, mean abs err, max err / row absmax, relative RMS err, weight values)."""
    by_table = {s.table: s for s in trainer.shards}
    mx = mean_sum = rel_row = 0.0
    sq_err = sq_val = 0.0
    n = 0
    for part in parts:
        for rec in part.shards:
            live = by_table[rec.table].states["weight"]
            for c in rec.chunks:
                key = f"step-{1:012d}/{c.path}"
                a = decode_chunk(storage.get(key), c, key, allow_quantized=True)
                exact = live.index_select(0, a["ids"] - rec.row_offset)
                err = (a["weight"] - exact).abs()
                absmax = exact.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
                mx = max(mx, float(err.max()))
                rel_row = max(rel_row, float((err / absmax).max()))
                mean_sum += float(err.sum(dtype=torch.float64))
                sq_err += float((err.double() ** 2).sum())
                sq_val += float((exact.double() ** 2).sum())
                n += err.numel()
    return mx, mean_sum / max(n, 1), rel_row, (sq_err / max(sq_val, 1e-300)) ** 0.5, n


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--intervals", type=int, default=10)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--weights", choices=["workload", "heavy", "both"], default="both")
    a = p.parse_args(argv)
    w = Workload(tables=a.tables, rows=a.rows, dim=a.dim, chunk_bytes=4 << 20)
    print(f"workload: {w.describe()}; {a.intervals} intervals, delta of the last one")
    kinds = ["workload", "heavy"] if a.weights == "both" else [a.weights]
    with tempfile.TemporaryDirectory(prefix="deck-bench-quant-") as tmp:
        trainer = ZipfTrainer(w, LocalStorage(os.path.join(tmp, "train")))
        for _ in range(a.intervals - 1):
            trainer.interval()
        rows = trainer.interval()
        print(f"delta rows: {sum(int(r.numel()) for r in rows)} of {w.tables * w.rows}")
        for kind in kinds:
            if kind == "heavy":
                heavy_tailed(w, trainer)
            print(f"\nweights: {kind}")
            print(
                "| encoding | delta bytes | saved | write s | max abs err | mean abs err "
                "| max err / row absmax | rel. RMS err |"
            )
            print("|---|---|---|---|---|---|---|---|")
            exact_bytes = 0
            for enc in ENCODINGS:
                parts, secs, storage = write_delta(os.path.join(tmp, kind), trainer, rows, enc)
                nbytes = sum(c.nbytes for pt in parts for r in pt.shards for c in r.chunks)
                exact_bytes = exact_bytes or nbytes
                mx, mean, rel_row, rms, _ = errors(storage, parts, trainer)
                print(
                    f"| {enc or 'exact'} | {nbytes / 2**20:.1f} MiB | "
                    f"{100 * (1 - nbytes / exact_bytes):.1f}% | {secs:.2f} | {mx:.3g} | "
                    f"{mean:.3g} | {rel_row:.3g} | {rms:.3g} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
