"""Zero-copy (memory-mapped) restore vs the bytes restore vs raw sequential reads of the same files.

Writes one full checkpoint of ~1 GiB (the Zipf DLRM workload of benchmarks/_workload.py: tables
of fp32 rows + a rowwise momentum, real writer and on-disk format, one rank), then in rounds
(the mode order rotates every round) measures:

- ``raw read``: every chunk file of the checkpoint read whole, in key order, with ``readinto`` into
  one reused 64 MiB buffer (large sequential reads; no parsing, no copies): the baseline;
- ``restore, mmap``: ``apply_chain`` with ``zero_copy=True`` (chunk files memory-mapped, rows copied
  from the mapping into the tables, checksum over the mapping);
- ``restore, bytes``: ``apply_chain`` with ``zero_copy=False`` (each file read into ``bytes``).

Before every cold measurement each chunk file is dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (the files were fsynced by the writer, so their pages are
clean and the hint is honoured). The same modes are then timed warm (files in the page cache).
Restores go into freshly allocated, pre-faulted tables and are checked bitwise against the saved
state. Throughput is chunk bytes / seconds.

    python benchmarks/bench_restore_mmap.py [--rows 500000] [--tables 8] [--dim 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _workload import (
    Workload,
    ZipfTrainer,
    bitwise_equal,
    drop_cache,
    in_workdir,
    make_shards,
    table_shapes,
)

from deck.format.manifest import CheckpointManifest
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.read.restore import apply_chain
from deck.storage import LocalStorage

MODES = ("raw read", "restore, mmap", "restore, bytes")


def _raw_read(paths: list[str], buf: bytearray) -> int:
    view = memoryview(buf)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def _restore(
    storage: LocalStorage,
    chain: list[CheckpointManifest],
    w: Workload,
    zero_copy: bool,
    expect: dict[str, torch.Tensor],
) -> Callable[[], int]:
    """A timed closure over fresh, pre-faulted tables (allocated outside the timer)."""
    shards = make_shards(w, fill=0.0)

    def run() -> int:
        stats, _ = apply_chain(storage, chain, shards, table_shapes(w), zero_copy=zero_copy)
        state = {f"{s.table}|{k}": v for s in shards for k, v in s.states.items()}
        if not bitwise_equal(state, expect):
            raise SystemExit(f"restore (zero_copy={zero_copy}) differs from the saved state")
        return stats.bytes

    return run


def main(argv: list[str] | None = None) -> int:
    # One compute thread, like each rank of the demo (a 2-core shared box).
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    a = p.parse_args(argv)
    w = Workload(tables=a.tables, rows=a.rows, dim=a.dim, ranks=1)
    return in_workdir(a.out, "deck-bench-mmap-", lambda work: _run(a, w, work))


def _run(a: argparse.Namespace, w: Workload, work: str) -> int:
    print("command: python " + " ".join([sys.argv[0], *sys.argv[1:]]), flush=True)
    storage = LocalStorage(os.path.join(work, "run"))
    tr = ZipfTrainer(w, storage)
    m = tr.save("full")
    expect = {f"{s.table}|{k}": v.clone() for s in tr.shards for k, v in s.states.items()}
    del tr
    chain = chain_for(read_manifests(storage), m.step)
    paths = [storage.local_path(k) for k in storage.list(f"{m.folder}/") if k.endswith(".chunk")]
    nbytes = sum(os.path.getsize(p) for p in paths)
    print(
        f"workload: {w.describe()}; one full of {nbytes / 2**30:.2f} GiB in {len(paths)} chunk "
        f"files of {w.chunk_bytes // 2**20} MiB; {a.repeats} rounds, cold then warm",
        flush=True,
    )
    buf = bytearray(64 * 2**20)
    times: dict[tuple[str, str], list[float]] = {
        (c, md): [] for c in ("cold", "warm") for md in MODES
    }
    for r in range(a.repeats):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for cache in ("cold", "warm"):
            for mode in order:
                if mode == "raw read":
                    fn: Callable[[], int] = lambda: _raw_read(paths, buf)  # noqa: E731
                else:
                    fn = _restore(storage, chain, w, mode == "restore, mmap", expect)
                if cache == "cold":
                    drop_cache(paths)
                else:
                    _raw_read(paths, buf)  # make sure every page is cached
                t0 = time.perf_counter()
                got = fn()
                dt = time.perf_counter() - t0
                if got != nbytes:
                    raise SystemExit(f"{mode} read {got} bytes, expected {nbytes}")
                times[(cache, mode)].append(dt)
                print(f"  round {r} {cache:4s} {mode:15s} {dt:6.3f} s", flush=True)
    print()
    print("| page cache | mode | median | min | MiB/s (median) | vs raw read (median) |")
    print("|---|---|---|---|---|---|")
    for cache in ("cold", "warm"):
        base = statistics.median(times[(cache, "raw read")])
        for mode in MODES:
            ts = times[(cache, mode)]
            med = statistics.median(ts)
            print(
                f"| {cache} | {mode} | {med:.3f} s | {min(ts):.3f} s | "
                f"{nbytes / 2**20 / med:,.0f} | {base / med:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
