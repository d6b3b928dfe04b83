"""Sustained stager throughput to a target vs a plain sequential write of the same bytes to the
same target (goal: stager >= 80% of plain).

A synthetic model (``--tables`` plain-tensor TableShards, weight rows x 64 fp32 + momentum1, of
``--size-gib`` in all) is written as a FULL checkpoint through ``deck.trainer.staging.Stager`` +
``RankPartWriter``, as ``DeltaCheckpointer.save`` drives them. Stager time = from ``begin`` to
``flush`` returning with the checkpoint committed: gather into chunk buffers, xxh3 checksums,
first-tier writes, fsync, upload, part manifest and commit record all included. Bytes = the chunk
files it wrote (``writer.bytes_written``).

Plain writes of the same bytes (the same number of files/objects of the same sizes as the
stager's chunks, read from the model's memory, no gather, no checksum):

- local directory (stager tier ``local``: each chunk file is written with O_DIRECT from its
  page-aligned buffer where the filesystem allows it, else buffered; a background thread fsyncs
  each file as soon as it is written, then the directory):
  - ``files, fsync at end``: f.write each file, then fsync every file and the directory: the same
    durability as the stager (the faithful baseline, used for the ratio);
  - ``files, fsync each``: fsync each file right after writing it (the naive sequential way);
  - ``one file, 1 fsync``: all bytes into one file in chunk-size writes, one fsync (the best a
    sequential writer can do; it has a single file to sync).
- SeaweedFS S3 (started by this script; stager tiers ``cpu-ssd-remote`` = spool on /tmp then
  upload, and ``cpu-remote`` = upload from the CPU buffers; upload_concurrency 4):
  - ``pipe_file seq``: s3fs ``pipe_file`` of each object, one at a time;
  - ``pipe_file x4``: the same with 4 threads, the stager's upload concurrency (used for the ratio).

Modes run interleaved so machine noise hits them alike; each mode's output is deleted right after
it is timed; and the order of each repeat is a row of a Williams (balanced Latin) square, so over
every ``len(modes)`` repeats each mode runs right after each other mode exactly once. That
matters on this Firecracker VM: how fast a write fills the page cache depends on what the
previous mode freed (measured: the same 1 GiB of chunk writes took 0.2 s after one mode and 0.8-2 s
after another), and a plain rotation keeps the cyclic order, so one mode always followed the same
predecessor and paid for it every time.

    python benchmarks/bench_stager_throughput.py [--size-gib 1] [--targets local,s3] [--repeats 4]
    python benchmarks/bench_stager_throughput.py --quick      # 0.25 GiB
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from _workload import save_full, williams_order

from deck.config import StagingConfig
from deck.format.chunks import ChunkLayout
from deck.model import TableShard
from deck.storage import Storage, open_storage
from deck.trainer.staging import Stager

MIB = 2**20
GOAL = 0.8


def make_model(total_bytes: int, tables: int, dim: int) -> tuple[list[TableShard], torch.Tensor]:
    """Shards that are views into one random byte buffer (which plain writes read from)."""
    rows = total_bytes // tables // (dim * 4 + 4)
    per_table = rows * (dim * 4 + 4)
    flat = torch.empty(per_table * tables, dtype=torch.uint8)
    flat.view(torch.float32).uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(0))
    shards = []
    for i in range(tables):
        base = flat[i * per_table : (i + 1) * per_table]
        shards.append(
            TableShard.whole(
                f"m.embedding_bags.t{i}.weight",
                {
                    "weight": base[: rows * dim * 4].view(torch.float32).view(rows, dim),
                    "momentum1": base[rows * dim * 4 :].view(torch.float32),
                },
            )
        )
    return shards, flat


def stager_save(
    storage: Storage, cfg: StagingConfig, shards: list[TableShard], step: int
) -> dict[str, Any]:
    """A full checkpoint through a fresh Stager; seconds from begin to committed."""
    stager = Stager(storage, cfg, rank=0)
    stats, part = save_full(stager, storage, shards, step, cfg)
    seconds = time.perf_counter() - stats.started
    stager.close()
    sizes = [c.nbytes for s in part.shards for c in s.chunks]
    return {"seconds": seconds, "stall": stats.stall_s, "bytes": stats.bytes, "sizes": sizes}


def chunk_sizes(shards: list[TableShard], chunk_bytes: int) -> list[int]:
    """Sizes of the chunk files RankPartWriter writes for a full checkpoint of ``shards``."""
    sizes = []
    for sh in shards:
        segs = [("ids", torch.int64, ())] + [
            (k, t.dtype, tuple(t.shape[1:])) for k, t in sh.states.items()
        ]
        per_chunk = (chunk_bytes - ChunkLayout.overhead(len(segs))) // sh.row_bytes()
        for start in range(0, sh.rows, per_chunk):
            rows = min(per_chunk, sh.rows - start)
            last = start + rows == sh.rows
            n = ChunkLayout(rows, segs).nbytes
            sizes.append(n if last else max(n, chunk_bytes))
    return sizes


def check_sizes(got: list[int], expected: list[int]) -> None:
    if got != expected:
        raise RuntimeError(
            f"the stager wrote {len(got)} chunks / {sum(got)} bytes, the plain baseline would "
            f"write {len(expected)} / {sum(expected)}: update chunk_sizes()"
        )


def _views(flat: torch.Tensor, sizes: list[int]) -> list[memoryview]:
    """Consecutive slices of the model's bytes with the stager's chunk sizes (wrapping around)."""
    mv = memoryview(flat.numpy()).cast("B")
    out, off = [], 0
    for n in sizes:
        if off + n > len(mv):
            off = 0
        out.append(mv[off : off + n])
        off += n
    return out


def _fsync_path(path: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_files(folder: str, views: list[memoryview], fsync_each: bool) -> float:
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    paths = []
    for i, v in enumerate(views):
        path = os.path.join(folder, f"{i:06d}.chunk")
        with open(path, "wb") as f:
            f.write(v)
            if fsync_each:
                f.flush()
                os.fsync(f.fileno())
        paths.append(path)
    if not fsync_each:
        for path in paths:
            _fsync_path(path)
    _fsync_path(folder, os.O_RDONLY | os.O_DIRECTORY)
    return time.perf_counter() - t0


def plain_one_file(folder: str, views: list[memoryview]) -> float:
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(folder, "all.bin"), "wb") as f:
        for v in views:
            f.write(v)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(folder, os.O_RDONLY | os.O_DIRECTORY)
    return time.perf_counter() - t0


def plain_s3(fs: Any, prefix: str, views: list[memoryview], threads: int) -> float:
    def put(i: int) -> None:
        fs.pipe_file(f"{prefix}/{i:06d}.chunk", bytes(views[i]))  # botocore wants bytes

    t0 = time.perf_counter()
    if threads == 1:
        for i in range(len(views)):
            put(i)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, range(len(views))))
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="0.25 GiB")
    p.add_argument("--size-gib", type=float, default=None, help="model size (default 1)")
    p.add_argument("--targets", default="local,s3", help="local and/or s3 (SeaweedFS)")
    p.add_argument(
        "--repeats", type=int, default=4, help="repeats of each S3 mode (a multiple of 4: balanced)"
    )
    p.add_argument(
        "--local-repeats",
        type=int,
        default=8,
        help="repeats of each local mode (cheap, and the local disk is the noisiest; a multiple "
        "of 4 keeps the order balanced)",
    )
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    a = p.parse_args()
    size = a.size_gib or (0.25 if a.quick else 1.0)
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    if set(targets) - {"local", "s3"}:
        p.error("--targets takes local and/or s3")
    torch.set_num_threads(1)
    work = a.workdir or tempfile.mkdtemp(prefix="deck-bench-tput-", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    shards, flat = make_model(int(size * 2**30), a.tables, a.dim)
    server = None
    results: dict[tuple[str, str], list[float]] = {}
    try:
        modes: dict[str, list[tuple[str, Callable[[int], float]]]] = {}
        sizes = chunk_sizes(shards, StagingConfig().chunk_bytes)
        staged: list[float] = []  # the stager's time until every chunk was in its first tier
        total = sum(sizes)
        if "local" in targets:
            cfg = StagingConfig(tiers="local")

            def local_stager(rep: int) -> float:
                storage = open_storage(os.path.join(work, "ck-local"))
                r = stager_save(storage, cfg, shards, rep)
                check_sizes(r["sizes"], sizes)
                staged.append(r["stall"])
                return r["seconds"]

            def local_plain(kind: str) -> Callable[[int], float]:
                def run(rep: int) -> float:
                    views = _views(flat, sizes)
                    folder = os.path.join(work, f"plain-{kind}-{rep}")
                    if kind == "one":
                        return plain_one_file(folder, views)
                    return plain_files(folder, views, fsync_each=kind == "each")

                return run

            modes["local"] = [
                ("stager (tier local)", local_stager),
                ("files, fsync at end", local_plain("end")),
                ("files, fsync each", local_plain("each")),
                ("one file, 1 fsync", local_plain("one")),
            ]
        if "s3" in targets:
            import s3fs

            from deck.testing.s3_server import SeaweedS3

            server = SeaweedS3(workdir=os.path.join(work, "seaweed"), volume_size_limit_mb=1024)
            server.start()
            print(
                f"SeaweedFS S3 at {server.endpoint_url} (started in {server.startup_seconds:.1f} s)"
            )
            opts = server.storage_options
            fs = s3fs.S3FileSystem(
                key=opts["key"], secret=opts["secret"], client_kwargs=opts["client_kwargs"]
            )

            def s3_stager(tiers: str) -> Callable[[int], float]:
                def run(rep: int) -> float:
                    storage = open_storage(server.uri(f"tput/{tiers}-{rep}"), opts)  # type: ignore[union-attr]
                    cfg = StagingConfig(tiers=tiers, spool_dir=os.path.join(work, "spool"))  # type: ignore[arg-type]
                    r = stager_save(storage, cfg, shards, rep)
                    check_sizes(r["sizes"], sizes)
                    staged.append(r["stall"])
                    return r["seconds"]

                return run

            def s3_plain(threads: int) -> Callable[[int], float]:
                def run(rep: int) -> float:
                    views = _views(flat, sizes)
                    return plain_s3(fs, f"{server.bucket}/plain-{threads}-{rep}", views, threads)  # type: ignore[union-attr]

                return run

            # Warm-up: connections, imports.
            plain_s3(fs, f"{server.bucket}/warmup", _views(flat, [4 * MIB] * 8), 4)
            modes["s3"] = [
                ("stager (cpu-ssd-remote)", s3_stager("cpu-ssd-remote")),
                ("stager (cpu-remote)", s3_stager("cpu-remote")),
                ("pipe_file seq", s3_plain(1)),
                ("pipe_file x4", s3_plain(4)),
            ]
        for target, ms in modes.items():
            for rep in range(a.local_repeats if target == "local" else a.repeats):
                order = williams_order(len(ms), rep)
                for name, fn in [ms[i] for i in order]:
                    staged.clear()
                    s = fn(rep)
                    results.setdefault((target, name), []).append(s)
                    print(
                        f"  {target:<5} rep {rep} {name:<24} {s:7.2f} s "
                        f"{total / s / MIB:8.1f} MiB/s"
                        + (f" (training released after {staged[0]:.2f} s)" if staged else ""),
                        flush=True,
                    )
                    # Remove this mode's output before the next mode runs, so that every mode
                    # starts from the same page-cache / bucket state.
                    if target == "local":
                        for d in os.listdir(work):
                            if d.startswith(("plain-", "ck-local")):
                                shutil.rmtree(os.path.join(work, d), ignore_errors=True)
                    else:
                        fs.invalidate_cache()
                        for d in fs.ls(server.bucket):  # type: ignore[union-attr]
                            fs.rm(d, recursive=True)
                        fs.invalidate_cache()
    finally:
        if server is not None:
            server.stop()
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(
        f"synthetic model {flat.numel() / 2**30:.3f} GiB ({a.tables} tables x "
        f"{shards[0].rows} rows x {a.dim} fp32 + momentum1), full checkpoint = {total / MIB:.0f} MiB "
        f"in {len(sizes)} chunk files of {StagingConfig().chunk_bytes / MIB:.0f} MiB; "
        f"{a.local_repeats} local / {a.repeats} S3 repeats, interleaved"
    )
    print(
        f"{'target':<6} {'mode':<24} {'median s':>9} {'min s':>7} {'MiB/s':>7} "
        f"{'vs baseline (median)':>21} {'(best of)':>10}"
    )
    baselines = {"local": "files, fsync at end", "s3": "pipe_file x4"}
    verdicts = []
    for target in modes:
        base = statistics.median(results[(target, baselines[target])])
        base_min = min(results[(target, baselines[target])])
        for name, _ in modes[target]:
            med = statistics.median(results[(target, name)])
            mn = min(results[(target, name)])
            print(
                f"{target:<6} {name:<24} {med:>9.2f} {mn:>7.2f} {total / med / MIB:>7.1f} "
                f"{base / med:>20.2f}x {base_min / mn:>9.2f}x"
            )
        for name, _ in modes[target]:
            if name.startswith("stager"):
                med = statistics.median(results[(target, name)])
                mn = min(results[(target, name)])
                best = min(
                    statistics.median(v)
                    for (t, n), v in results.items()
                    if t == target and not n.startswith("stager")
                )
                verdicts.append(
                    f"{target}: {name} = {base / med:.2f} of '{baselines[target]}' by medians "
                    f"({'MET' if base / med >= GOAL else 'NOT MET'}; best-of {base_min / mn:.2f}), "
                    f"{best / med:.2f} of the fastest plain write"
                )
    print()
    for v in verdicts:
        print(v)
    print()
    print("reproduce: " + " ".join([os.path.relpath(sys.executable), *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
