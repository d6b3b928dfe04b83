"""Merge velocity against the disk, and the shortest delta interval one merger worker sustains.

Part 1, **throughput against a plain copy of the same bytes** (same disk, same I/O modes, one
run). Two merger items are built from a store of the demo's workload (benchmarks/_workload.py:
the demo's tables as plain tensors, the real writer and format):

- ``new full``: the trainer's full + 3 deltas -> one merger full (stride 4, a full every 3 deltas);
- ``L1 merge``: 4 deltas -> one merged delta (no fulls).

Each is timed as ``MergeWorker.run_once()`` (listing, planning, reading, merging, writing and
committing), its bytes read + written taken from the worker's own counters. Against it, with the
inputs evicted from the page cache before every run (as the recovery benchmark does):

- ``python copy``: read every input chunk file the way the merger does (buffered, one read per
  file), write the same number of bytes the merger wrote as chunk-sized files from one page-aligned
  buffer with O_DIRECT + fsync per file (the merger's write mode, without its rename / directory
  fsync, which count against the merger);
- ``cat | dd``: ``cat`` of the input files (buffered reads) piped to ``dd oflag=direct
  conv=fsync bs=4M``: a plain copy of the input bytes (read R, write R).

Ratio = merger's (read + written) bytes/s over the copy's; goal >= 0.70. Medians of
``--repeats`` rounds, each round running the three in turn.

Part 2, **shortest interval keeping restore <= 1.3x one full**. A simulated trainer writes a delta
every ``I`` seconds of a virtual clock (training and writing cost no virtual time: on a real
deployment they run beside the merger); one merger worker runs pass after pass in real time, and
the clock advances by each pass's measured duration (or jumps to the next delta when idle). At
every delta of the second half of the run the cheapest chain to the newest step is recorded;
the chain with the most bytes (the worst moment) is then restored from a cold cache, in rounds
alternating with one full of the same size (medians). Swept over ``--intervals``; printed: the
shortest interval down to which every interval swept meets the goal. The sweep ignores CPU / disk contention between trainer and merger (one process
here) and the restore is timed, not checked bitwise (tests/merge/test_lineage_merger.py does that);
the final state of each run is checked bitwise.

    python benchmarks/bench_merge_velocity.py [--rows 250000] [--repeats 5]
        [--intervals 0.26,0.5,1,2,4] [--deltas 24] [--full-live-fraction 0.1]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _workload import (
    Workload,
    ZipfTrainer,
    bitwise_equal,
    drop_cache,
    in_workdir,
    restore_into_fresh,
)

from deck.format.manifest import CheckpointManifest
from deck.merge.policy import FullPolicy, MergeConfig
from deck.merge.worker import MergeWorker
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.storage import LocalStorage

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _files(storage: LocalStorage, ms: list[CheckpointManifest]) -> list[str]:
    return sorted(
        os.path.join(folder, name)
        for m in ms
        for folder, _, names in os.walk(storage.local_path(m.folder))
        for name in names
        if name.endswith(".chunk")
    )


def _python_copy(inputs: list[str], out_dir: str, write_bytes: int, chunk: int) -> float:
    """Read ``inputs`` like the merger, write ``write_bytes`` as O_DIRECT chunk files."""
    os.makedirs(out_dir, exist_ok=True)
    buf = mmap.mmap(-1, chunk)  # page-aligned, like the merger's chunk buffer
    view = memoryview(buf)
    t0 = time.perf_counter()
    left, n = write_bytes, 0
    for p in inputs:
        with open(p, "rb", buffering=0) as f:
            data = f.readall()
        # Carry read bytes into the output buffer, as the merger's encode does (one copy), and
        # write as the reads go, as the merger does.
        k = min(len(data), chunk)
        view[:k] = data[:k]
        if left > 0:
            left = _write_direct(os.path.join(out_dir, f"{n:06d}.chunk"), view, left)
            n += 1
    while left > 0:
        left = _write_direct(os.path.join(out_dir, f"{n:06d}.chunk"), view, left)
        n += 1
    dt = time.perf_counter() - t0
    view.release()
    buf.close()
    return dt


def _write_direct(path: str, view: memoryview, left: int) -> int:
    n = min(len(view), (left + 4095) // 4096 * 4096)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
    try:
        os.write(fd, view[:n])
        os.fsync(fd)
    finally:
        os.close(fd)
    return left - n


def _dd_copy(inputs: list[str], out: str) -> float:
    t0 = time.perf_counter()
    cat = subprocess.Popen(["cat", *inputs], stdout=subprocess.PIPE)
    subprocess.run(
        [
            "dd",
            f"of={out}",
            "bs=4M",
            "iflag=fullblock",
            "oflag=direct",
            "conv=fsync",
            "status=none",
        ],
        stdin=cat.stdout,
        check=True,
    )
    assert cat.stdout is not None
    cat.stdout.close()
    if cat.wait() != 0:
        raise SystemExit("cat failed")
    return time.perf_counter() - t0


def throughput(a: argparse.Namespace, w: Workload, work: str) -> None:
    print("\n== part 1: merger bytes/s vs a plain copy of the same bytes (same disk and modes)")
    scenarios = {
        "new full (full + 3 deltas)": (
            3,
            MergeConfig(stride=4, full=FullPolicy(every=3, max_live_fraction=None)),
        ),
        "L1 merge (4 deltas)": (
            4,
            MergeConfig(stride=4, full=FullPolicy(every=None, max_live_fraction=None)),
        ),
    }
    print(
        f"{'item':<28} {'read':>10} {'written':>10} {'merger':>8} {'py copy':>8} {'dd copy':>8}"
        f" {'merger MB/s':>11} {'py MB/s':>8} {'dd MB/s':>8} {'vs py':>6} {'vs dd':>6}"
    )
    for name, (deltas, cfg) in scenarios.items():
        root = os.path.join(work, f"tp-{deltas}")
        storage = LocalStorage(root)
        tr = ZipfTrainer(w, storage)
        tr.save("full")
        for _ in range(deltas):
            tr.interval()
            tr.save()
        trainer_ms = [m for _, m in sorted(read_manifests(storage).items())]
        ms = trainer_ms if cfg.full.every else trainer_ms[1:]
        inputs = _files(storage, ms)
        merged_dir = os.path.join(root, "merged")
        t_m, t_py, t_dd = [], [], []
        r_bytes = w_bytes = 0
        for _ in range(a.repeats):
            shutil.rmtree(merged_dir, ignore_errors=True)
            drop_cache(inputs)
            t0 = time.perf_counter()
            stats, _ = MergeWorker(storage, cfg).run_once()
            t_m.append(time.perf_counter() - t0)
            if stats.items_committed != 1:
                raise SystemExit(f"{name}: expected one item, built {stats.items_committed}")
            r_bytes, w_bytes = stats.bytes_read, stats.bytes_written
            copy_dir = os.path.join(work, "copy")
            shutil.rmtree(copy_dir, ignore_errors=True)
            drop_cache(inputs)
            t_py.append(_python_copy(inputs, copy_dir, w_bytes, w.chunk_bytes))
            shutil.rmtree(copy_dir, ignore_errors=True)
            drop_cache(inputs)
            os.makedirs(copy_dir)
            t_dd.append(_dd_copy(inputs, os.path.join(copy_dir, "dd.out")))
            shutil.rmtree(copy_dir, ignore_errors=True)
        in_bytes = sum(os.path.getsize(p) for p in inputs)
        m, py, dd = (statistics.median(t) for t in (t_m, t_py, t_dd))
        mbs, pybs, ddbs = (r_bytes + w_bytes) / m, (r_bytes + w_bytes) / py, 2 * in_bytes / dd
        print(
            f"{name:<28} {_mib(r_bytes):>10} {_mib(w_bytes):>10} {m:>7.3f}s {py:>7.3f}s "
            f"{dd:>7.3f}s {mbs / 1e6:>11.0f} {pybs / 1e6:>8.0f} {ddbs / 1e6:>8.0f} "
            f"{mbs / pybs:>5.2f}x {mbs / ddbs:>5.2f}x"
        )
        ok = mbs >= 0.7 * pybs and mbs >= 0.7 * ddbs
        print(f"  goal >= 0.70 of the copy's bytes/s: {'met' if ok else 'NOT met'}")
        shutil.rmtree(root)


def sweep(a: argparse.Namespace, w: Workload, work: str) -> None:
    print(
        f"\n== part 2: one worker, a delta every I s (virtual clock), {a.deltas} deltas; worst "
        "restore of the second half vs one full"
    )
    print(
        f"{'interval s':>10} {'fulls':>5} {'busy':>5} {'worst chain':>22} {'bytes':>11} "
        f"{'restore s':>9} {'full s':>7} {'vs full':>8}"
    )
    shortest, still_ok = None, True
    full_storage = LocalStorage(os.path.join(work, "one-full"))
    full_m: CheckpointManifest | None = None
    for interval in sorted(a.intervals, reverse=True):
        root = os.path.join(work, f"sweep-{interval:g}")
        storage = LocalStorage(root)
        tr = ZipfTrainer(w, storage)
        tr.save("full")
        full = FullPolicy(max_live_fraction=a.full_live_fraction)
        worker = MergeWorker(storage, MergeConfig(stride=a.stride, full=full))
        clock, busy, written = 0.0, 0.0, 0
        recorded: list[list[CheckpointManifest]] = []
        while written < a.deltas:
            # Every delta due by now is written (at no cost to the clock).
            due = min(a.deltas, int(clock / interval + 1e-9))
            while written < due:
                tr.interval()
                tr.save()
                written += 1
                if written > a.deltas // 2:
                    recorded.append(chain_for(read_manifests(storage), tr.step))
            t0 = time.perf_counter()
            r = worker.run_pass()
            dt = time.perf_counter() - t0
            if r.stats.items_committed:
                busy += dt
                clock += dt
            else:
                clock = max(clock + dt, (written + 1) * interval)
        live = tr.live()
        final = chain_for(read_manifests(storage), tr.step)
        _, state, _ = restore_into_fresh(storage, final, w)
        if not bitwise_equal(state, live):
            raise SystemExit(f"interval {interval}: restored state differs from the live state")
        del state
        fulls = sum(1 for m in read_manifests(storage).merged.values() if m.kind.value == "full")
        worst = max(recorded, key=lambda c: sum(m.data_bytes for m in c))
        if full_m is None:
            full_m = tr.save("full", storage=full_storage)
        # Rounds alternating the full and the chain, so machine noise hits both alike.
        ft, rt = [], []
        for _ in range(a.repeats):
            drop_cache(_files(full_storage, [full_m]))
            ft.append(restore_into_fresh(full_storage, [full_m], w)[0])
            drop_cache(_files(storage, worst))
            rt.append(restore_into_fresh(storage, worst, w)[0])
        t, full_t = statistics.median(rt), statistics.median(ft)
        full_bytes = full_m.data_bytes
        kinds = ["F" if m.kind.value == "full" else f"L{m.layer}" for m in worst]
        desc = " + ".join(f"{kinds.count(k)}x{k}" for k in dict.fromkeys(kinds))
        wb = sum(m.data_bytes for m in worst)
        print(
            f"{interval:>10.2f} {fulls:>5} {busy / clock:>4.0%} {desc[:22]:>22} {_mib(wb):>11} "
            f"{t:>9.3f} {full_t:>7.3f} {t / full_t:>7.2f}x ({wb / full_bytes:.2f}x bytes)",
            flush=True,
        )
        if t <= 1.3 * full_t and still_ok:
            shortest = interval
        else:
            still_ok = False
        shutil.rmtree(root)
    if shortest is None:
        print("shortest interval keeping restore <= 1.3x one full: none of those swept")
    else:
        print(
            f"shortest interval keeping restore <= 1.3x one full: {shortest:g} s (of those swept)"
        )


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)  # one compute thread, like each demo rank
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=250_000, help="rows per table (demo: 250000)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--full-live-fraction",
        type=float,
        default=FullPolicy.model_fields["max_live_fraction"].default,
        help="the sweep's full policy: a new full when the live chain passes this fraction of "
        "a full (deck merge --full-live-fraction)",
    )
    p.add_argument("--deltas", type=int, default=24)
    p.add_argument(
        "--intervals",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.26, 0.5, 1.0, 2.0, 4.0],
        help="delta intervals to sweep, seconds (the demo's: 10 steps x ~26-31 ms)",
    )
    p.add_argument("--skip", choices=("throughput", "sweep"), default=None)
    p.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    a = p.parse_args(argv)
    w = Workload(tables=a.tables, rows=a.rows, dim=a.dim)

    def run(work: str) -> int:
        print(f"workload: {w.describe()}")
        if a.skip != "throughput":
            throughput(a, w, work)
        if a.skip != "sweep":
            sweep(a, w, work)
        print("reproduce: python " + " ".join(sys.argv))
        return 0

    return in_workdir(a.out, "deck-bench-merge-velocity-", run)


if __name__ == "__main__":
    sys.exit(main())
