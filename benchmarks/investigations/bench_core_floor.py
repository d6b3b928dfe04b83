"""What does work on the spare core cost a pinned training thread on this machine, whoever does
it? The floor under deck's steps after a delta (docs/benchmarks-history.md, "The steps after a
delta, tenth pass").

One training rank as in ``bench_interference.py`` (world size 1, the demo's DLRM, its thread on
core 0) trains while another *process* on core 1 (no GIL shared, no memory map shared) runs one
of these without pause:

- ``none``: nothing;
- ``odirect``: writes a 23 MiB buffer to a file with O_DIRECT, fsyncs it, again (a delta's bytes,
  as deck's spool writer and ``bench_stall``'s plain writer write them);
- ``buffered``: the same through the page cache;
- ``memcpy``: copies 64 MiB with numpy (memory bandwidth);
- ``gather``: numpy ``take`` of 90k random rows of a 1 GiB table (memory latency, as deck's copy
  of a delta's rows);
- ``alu``: a shell busy loop (the core's execution units only).

Modes run in turn, ``--rounds`` times, ``--steps`` steps each; printed per round each mode's
median step against ``none`` of that round, then medians over rounds. What a mode costs here
is a property of the machine (shared memory bandwidth, the host's I/O path), not of deck: a
background writer of a delta's bytes pays it on this machine whatever its design.

    python benchmarks/investigations/bench_core_floor.py [--rounds 5] [--steps 80]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

# bench_interference (the pinned training rank) lies one folder up, in benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_interference import pinned_rank

from deck.demo import ModelSpec, train_step
from deck.processes import end_rank

DELTA_BYTES = 23 << 20  # the demo's delta per rank at 1M rows per table (bench_interference)

_WRITE = """
import mmap, os, sys
os.sched_setaffinity(0, {1})
n, path, flags = int(sys.argv[1]), sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC
if sys.argv[3] == "odirect":
    flags |= os.O_DIRECT
buf = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT needs
buf.write(os.urandom(n))
while True:
    fd = os.open(path, flags)
    os.write(fd, buf)
    os.fsync(fd)
    os.close(fd)
"""
_MEMCPY = """
import os, numpy as np
os.sched_setaffinity(0, {1})
a = np.ones(64 << 20, np.uint8)
b = np.empty_like(a)
while True:
    np.copyto(b, a)
"""
_GATHER = """
import os, numpy as np
os.sched_setaffinity(0, {1})
table = np.ones((4_000_000, 64), np.float32)
rows = np.random.default_rng(0).integers(0, len(table), 90_000)
while True:
    table.take(rows, axis=0)
"""
MODES = ("none", "odirect", "buffered", "memcpy", "gather", "alu")


def _start(mode: str, work: str) -> subprocess.Popen[bytes] | None:
    if mode == "none":
        return None
    if mode == "alu":
        return subprocess.Popen(["taskset", "-c", "1", "sh", "-c", "while :; do :; done"])
    if mode in ("odirect", "buffered"):
        path = os.path.join(work, mode)
        return subprocess.Popen([sys.executable, "-c", _WRITE, str(DELTA_BYTES), path, mode])
    return subprocess.Popen([sys.executable, "-c", _MEMCPY if mode == "memcpy" else _GATHER])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    a = p.parse_args()
    modes = ["none", *[m for m in a.modes if m != "none"]]
    spec = ModelSpec(num_tables=8, rows=1_000_000, dim=64, batch=1024)
    model, dense = pinned_rank(spec)
    step = 0

    def median_step() -> float:
        nonlocal step
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            train_step(model, dense, spec, step)
            times.append(time.perf_counter() - t0)
            step += 1
        return statistics.median(times)

    for _ in range(20):
        train_step(model, dense, spec, 10**6)
    ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}
    base: list[float] = []
    with tempfile.TemporaryDirectory(prefix="deck-floor-") as work:
        for r in range(a.rounds):
            got = {}
            for mode in modes:
                proc = _start(mode, work)
                try:
                    time.sleep(0.5)  # the background at its pace before the steps count
                    got[mode] = median_step()
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
            base.append(got["none"])
            for m in modes[1:]:
                ratios[m].append(got[m] / got["none"] - 1)
            print(
                f"round {r + 1}: none {got['none'] * 1e3:.2f} ms; "
                + "  ".join(f"{m} {ratios[m][-1]:+.1%}" for m in modes[1:]),
                flush=True,
            )
    print(
        f"medians over {a.rounds} rounds (step without background {statistics.median(base) * 1e3:.2f}"
        " ms): " + "  ".join(f"{m} {statistics.median(v):+.1%}" for m, v in ratios.items())
    )
    print(
        "reproduce: python benchmarks/investigations/bench_core_floor.py " + " ".join(sys.argv[1:])
    )
    end_rank()  # exits the process


if __name__ == "__main__":
    main()
