"""What does a background thread on another core cost the training thread, by the kind of work
it does? The probe behind "why background work costs a thread on another core"
(docs/benchmarks-history.md, "The steps after a delta, third pass").

One training rank (world size 1, the demo's DLRM), its thread pinned to core 0; one background
thread pinned to core 1 that, every ``--every`` steps (at the step a checkpoint would be), works
for ``--work-ms`` of its own CPU time in one of these ways:

- ``none``: nothing (the baseline);
- ``native``: copies memory with numpy in 1 MiB pieces (the GIL released, as deck's native copy);
- ``python``: a pure-Python loop (the GIL held until the interpreter's switch interval forces it
  off);
- ``pyslices``: the same loop, giving the GIL back every ~100 iterations (``time.sleep(0)``);
- ``syscalls``: ``os.stat`` in a loop (each call gives the GIL back and takes it again, as deck's
  background threads do at every file operation).

Printed per mode and repeat: the median step time away from the work and the sum, over the
``AFTER`` steps after it, of each step's median excess. deck itself does not run.

With ``--deck``, deck's own background instead: the same rank trains with deck (a delta every
``--every`` steps, ``--copy-on-write``, ``--chunk-bytes``); after each delta's call returns the
training thread runs a pure-Python loop for 150 ms instead of steps and counts its iterations
per 0.25 ms against the same loop with nothing running: the milliseconds it lost are the time
deck's background threads (on core 1) held the GIL, or otherwise slowed core 0.

    python benchmarks/investigations/bench_gil_probe.py [--work-ms 15] [--repeats 2]
    python benchmarks/investigations/bench_gil_probe.py --deck [--copy-on-write deltas] [--deltas 16]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

# bench_interference (the pinned training rank) lies one folder up, in benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_interference import _pin_others, pinned_rank

from deck.demo import ModelSpec, train_step
from deck.processes import end_rank

AFTER = 10
MODES = ("none", "native", "python", "pyslices", "syscalls")
PIECE = 1 << 20


def _background(jobs: queue.Queue[str], work_s: float) -> None:
    os.sched_setaffinity(0, {1})
    src = np.frombuffer(os.urandom(64 * PIECE), np.uint8)
    dst = np.empty_like(src)
    while True:
        mode = jobs.get()
        t0, n, at = time.thread_time(), 0, 0
        while time.thread_time() - t0 < work_s:
            if mode == "native":
                np.copyto(dst[at : at + PIECE], src[at : at + PIECE])
                at = (at + PIECE) % (63 * PIECE)
            elif mode == "syscalls":
                for _ in range(20):
                    os.stat("/")
            elif mode == "python":
                for _ in range(1000):
                    n += 1
            else:
                for _ in range(100):
                    n += 1
                time.sleep(0)


def _probe(ms: float, bucket_s: float = 0.00025) -> list[int]:
    """A pure-Python loop for ``ms``: its iterations in each ``bucket_s``."""
    out: list[int] = []
    end = time.perf_counter() + ms / 1e3
    bucket_end = time.perf_counter() + bucket_s
    n = 0
    while True:
        for _ in range(20):
            n += 1
        now = time.perf_counter()
        if now >= bucket_end:
            out.append(n)
            n, bucket_end = 0, bucket_end + bucket_s
            if now >= end:
                return out


def _deck_probe(a: argparse.Namespace, model: Any, dense: Any, spec: ModelSpec) -> None:
    import shutil
    import tempfile

    import deck
    from deck.config import StagingConfig

    work = tempfile.mkdtemp(prefix="deck-bench-gil-", dir="/tmp")
    staging = StagingConfig(copy_on_write=a.copy_on_write, chunk_bytes=a.chunk_bytes)
    cfg = deck.DeckConfig(uri=f"{work}/ck", delta_every_steps=a.every, staging=staging)
    ckpt = deck.enable(model, [dense], cfg)
    try:
        ckpt.step(0)
        ckpt.flush()
        _pin_others(1)
        idle = statistics.median(_probe(300))
        lost = []
        for d in range(a.deltas):
            for s in range(1, a.every + 1):
                train_step(model, dense, spec, d * a.every + s)
            ckpt.step((d + 1) * a.every)
            _pin_others(1)
            buckets = _probe(150)
            ckpt.flush()
            _pin_others(1)
            lost.append(sum(max(0.0, 1 - n / idle) for n in buckets) * 0.25)
    finally:
        ckpt.close()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"deck, copy_on_write={a.copy_on_write!r}, chunk_bytes={a.chunk_bytes}: a pure-Python "
        f"probe on the training thread lost {statistics.median(lost):.2f} ms (median) in the "
        f"150 ms after each of {a.deltas} deltas; each: " + " ".join(f"{x:.1f}" for x in lost)
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-ms", type=float, default=15.0)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (default: the interpreter's, 5 ms)",
    )
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--deck", action="store_true", help="probe deck's background instead")
    p.add_argument("--copy-on-write", default="deltas", choices=["deltas", "all", "off"])
    p.add_argument("--chunk-bytes", type=int, default=4 << 20)
    p.add_argument("--deltas", type=int, default=16)
    a = p.parse_args()
    if a.switch_interval_ms is not None:
        sys.setswitchinterval(a.switch_interval_ms / 1e3)
    if len(os.sched_getaffinity(0)) < 2:
        p.error("needs two cores (one for training, one for the background)")
    spec = ModelSpec(num_tables=8, rows=1_000_000, dim=64, batch=1024)
    model, dense = pinned_rank(spec)
    if a.deck:
        for _ in range(5):
            train_step(model, dense, spec, 10**6)
        _deck_probe(a, model, dense, spec)
        print(
            "reproduce: python benchmarks/investigations/bench_gil_probe.py "
            + " ".join(sys.argv[1:])
        )
        end_rank()
        return 0
    jobs: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_background, args=(jobs, a.work_ms / 1e3), daemon=True).start()
    for _ in range(5):
        train_step(model, dense, spec, 10**6)
    print(
        f"1 rank on core 0, a background thread on core 1 working {a.work_ms:g} ms of CPU every "
        f"{a.every} steps (switch interval {sys.getswitchinterval() * 1e3:g} ms); per mode and repeat: away median, and the sum of the {AFTER} "
        "steps' excess after the work"
    )
    for mode in a.modes:
        cells = []
        for _ in range(a.repeats):
            times = {}
            for step in range(1, a.steps + 1):
                t0 = time.perf_counter()
                train_step(model, dense, spec, step)
                times[step] = time.perf_counter() - t0
                if step % a.every == 0 and mode != "none":
                    jobs.put(mode)
            away = statistics.median(t for s, t in times.items() if s % a.every > AFTER)
            starts = range(a.every, a.steps - AFTER, a.every)
            excess = sum(
                statistics.median(times[d + k] for d in starts) - away for k in range(1, AFTER + 1)
            )
            cells.append(f"{away * 1e3:.2f} ms, {excess * 1e3:+.1f} ms")
        print(f"  {mode:<9} " + "; ".join(cells))
    print(
        "reproduce: python benchmarks/investigations/bench_gil_probe.py " + " ".join(sys.argv[1:])
    )
    end_rank()  # exits the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
