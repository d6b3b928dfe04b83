"""Bundled vs unbundled chunks (IncrCP concatenation): file count and restore time, same data.

Writes the same one-rank full checkpoint twice with the real writer and format (tables of fp32
rows + a rowwise momentum; small chunks, 64 KiB by default): once one file per chunk, once with
``bundle_bytes`` (4 MiB by default: 64 chunks per bundle). Then in rounds (the layout order
alternates) it restores each into fresh, pre-faulted tables with ``apply_chain``, checks the
result bitwise against the saved state, and times it: cold (every data file dropped from the
page cache with ``POSIX_FADV_DONTNEED`` first) and warm, with the mmap path (``zero_copy``) and
the bytes path (ranged reads).

    python benchmarks/bench_bundle.py [--rows 100000] [--tables 8] [--dim 64]
        [--chunk-bytes 65536] [--bundle-bytes 4194304] [--repeats 5]
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
from _workload import Workload, bitwise_equal, drop_cache, make_shards, table_shapes, warm_cache

from deck.format.manifest import Kind
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.read.restore import apply_chain
from deck.storage import LocalStorage
from deck.trainer.writer import RankPartWriter, commit


def _write(storage: LocalStorage, w: Workload, chunk_bytes: int, bundle_bytes: int) -> None:
    shards = make_shards(w)
    ckpt_id = secrets.token_hex(8)
    writer = RankPartWriter(storage, 0, ckpt_id, 0, 1, chunk_bytes, bundle_bytes=bundle_bytes)
    writer.write_part(shards, lambda s: None, None, {"scalars": {}})
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


def _data_files(storage: LocalStorage) -> list[str]:
    return [storage.local_path(k) for k in storage.list("") if k.endswith((".chunk", ".bin"))]


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)  # like each rank of the demo (a 2-core shared box)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--chunk-bytes", type=int, default=64 * 1024)
    p.add_argument("--bundle-bytes", type=int, default=4 * 2**20)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    print("command: python " + " ".join([sys.argv[0], *sys.argv[1:]]), flush=True)
    w = Workload(tables=a.tables, rows=a.rows, dim=a.dim, ranks=1)
    expect = {f"{s.table}|{k}": v.clone() for s in make_shards(w) for k, v in s.states.items()}
    work = tempfile.mkdtemp(prefix="deck-bench-bundle-")
    try:
        layouts = {"unbundled": 0, "bundled": a.bundle_bytes}
        stores = {}
        for name, b in layouts.items():
            stores[name] = LocalStorage(os.path.join(work, name))
            _write(stores[name], w, a.chunk_bytes, b)
        files = {n: _data_files(s) for n, s in stores.items()}
        nbytes = sum(os.path.getsize(p) for p in files["unbundled"])
        print(
            f"workload: {w.tables} tables x {w.rows} rows x {w.dim} dim fp32 + rowwise momentum, "
            f"one rank; one full of {nbytes / 2**20:.0f} MiB, chunk_bytes {a.chunk_bytes // 1024} "
            f"KiB, bundle_bytes {a.bundle_bytes // 2**20} MiB; {a.repeats} rounds",
            flush=True,
        )
        times: dict[tuple[str, str, str], list[float]] = {}
        for r in range(a.repeats):
            order = list(layouts) if r % 2 == 0 else list(reversed(layouts))
            for cache in ("cold", "warm"):
                for zero_copy in (True, False):
                    for name in order:
                        storage = stores[name]
                        chain = chain_for(read_manifests(storage), 0)
                        shards = make_shards(w, fill=0.0)
                        if cache == "cold":
                            drop_cache(files[name])
                        else:
                            warm_cache(files[name])
                        t0 = time.perf_counter()
                        stats, _ = apply_chain(
                            storage, chain, shards, table_shapes(w), zero_copy=zero_copy
                        )
                        dt = time.perf_counter() - t0
                        state = {f"{s.table}|{k}": v for s in shards for k, v in s.states.items()}
                        if not bitwise_equal(state, expect) or stats.bytes != nbytes:
                            raise SystemExit(f"{name} restore differs from the saved state")
                        mode = "mmap" if zero_copy else "bytes"
                        times.setdefault((cache, mode, name), []).append(dt)
                        print(f"  round {r} {cache} {mode:5s} {name:9s} {dt:6.3f} s", flush=True)
        print()
        print("| layout | data files | page cache | restore path | median | min | MiB/s (median) |")
        print("|---|---|---|---|---|---|---|")
        for (cache, mode, name), ts in sorted(times.items()):
            med = statistics.median(ts)
            print(
                f"| {name} | {len(files[name])} | {cache} | {mode} | {med:.3f} s | "
                f"{min(ts):.3f} s | {nbytes / 2**20 / med:,.0f} |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
