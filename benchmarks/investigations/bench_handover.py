"""What does one piece of background Python cost a training thread? The price of a GIL
hand-over (docs/benchmarks-history.md, "The steps after a delta, ninth pass").

``bench_interference.py`` finds that what deck's background costs the steps after a delta is
the training thread waiting for the GIL, ~50-70 times in steps 1-3, and that neither the number
of system calls nor the fsyncs change that. This measures the unit price without deck: ONE
training rank (the demo's DLRM, world size 1) with its training thread pinned to core 0, and one
background thread pinned to core 1 that, at every ``--every``-th step, runs a burst of ``K``
pieces, each ``P`` microseconds of Python followed by a system call that releases the GIL
(``os.stat``), as deck's stager threads do between native calls. Bursts of each ``(K, P)`` are
interleaved over the same run (drift touches all alike); per configuration: the excess of the
10 steps after a burst over the steps after an empty burst (``K = 0``), the training thread's
extra waits (voluntary context switches), and both per piece. (``bench_gil_probe.py`` compares
kinds of background work at a fixed total; this sweeps the length of the Python pieces.)

    python benchmarks/investigations/bench_handover.py [--steps 1200] [--pieces 0 16 32 64 128] [--micros 5 50]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time

# bench_interference (the pinned training rank) lies one folder up, in benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_interference import _waits, model_args, model_spec, pinned_rank

from deck.demo import train_step
from deck.processes import end_rank

AFTER = 10  # steps after a burst counted


class _Burster(threading.Thread):
    """On core 1: for each burst asked, ``pieces`` times ``micros`` µs of Python, then a system
    call that lets the GIL go and takes it back."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="burster")
        self.asked: list[tuple[int, int]] = []
        self.go = threading.Condition()

    def burst(self, pieces: int, micros: int) -> None:
        with self.go:
            self.asked.append((pieces, micros))
            self.go.notify()

    def run(self) -> None:
        os.sched_setaffinity(0, {1})
        while True:
            with self.go:
                self.go.wait_for(lambda: bool(self.asked))
                pieces, micros = self.asked.pop(0)
            for _ in range(pieces):
                end = time.perf_counter() + micros * 1e-6
                while time.perf_counter() < end:
                    pass
                os.stat("/")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    model_args(p, rows=100_000)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--every", type=int, default=15, help="steps from one burst to the next")
    p.add_argument("--pieces", type=int, nargs="+", default=[0, 16, 32, 64, 128])
    p.add_argument("--micros", type=int, nargs="+", default=[5, 50])
    a = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        p.error("needs two cores (one for training, one for the background)")
    spec = model_spec(a)
    model, dense = pinned_rank(spec)
    burster = _Burster()
    burster.start()
    configs = [(0, 0)] + [(k, u) for k in a.pieces if k for u in a.micros]
    order = itertools.cycle(configs)
    times: dict[tuple[int, int], list[list[float]]] = {c: [] for c in configs}
    waits: dict[tuple[int, int], list[list[int]]] = {c: [] for c in configs}
    current: tuple[int, int] | None = None
    for step in range(1, a.steps + 1):
        if step % a.every == 1 and step > 2 * a.every:  # (the first steps warm up)
            current = next(order)
            times[current].append([])
            waits[current].append([])
            burster.burst(*current)
        w0, t0 = _waits(), time.perf_counter()
        train_step(model, dense, spec, step)
        dt, dw = time.perf_counter() - t0, _waits() - w0
        if current is not None and len(times[current][-1]) < AFTER:
            times[current][-1].append(dt)
            waits[current][-1].append(dw)

    def per_burst(c: tuple[int, int]) -> tuple[float, float]:
        """Median over bursts of the 10 steps' summed time and waits."""
        whole = [
            (sum(t), sum(w)) for t, w in zip(times[c], waits[c], strict=True) if len(t) == AFTER
        ]
        return statistics.median(t for t, _ in whole), statistics.median(w for _, w in whole)

    base_t, base_w = per_burst((0, 0))
    n = len(times[(0, 0)])
    print(
        f"1 rank, training on core 0, a burst thread on core 1: DLRM {a.tables} x {a.rows} x "
        f"{a.dim}, batch {a.batch}; {n} bursts per configuration; the {AFTER} steps after an "
        f"empty burst: {base_t * 1e3:.1f} ms, {base_w:.0f} waits"
    )
    print(
        f"{'pieces':>6} {'µs each':>8} {'excess ms':>10} {'of 10 steps':>12} {'extra waits':>12} "
        f"{'µs per piece':>13} {'waits per piece':>16}"
    )
    for k, u in configs[1:]:
        t, w = per_burst((k, u))
        print(
            f"{k:>6} {u:>8} {(t - base_t) * 1e3:>+10.2f} {t / base_t - 1:>+12.1%} "
            f"{w - base_w:>+12.0f} {(t - base_t) / k * 1e6:>+13.0f} {(w - base_w) / k:>16.2f}"
        )
    print("reproduce: python benchmarks/investigations/bench_handover.py " + " ".join(sys.argv[1:]))
    end_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
