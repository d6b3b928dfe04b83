"""What GC's quarantine rule costs its plan, by history length: a quarantined checkpoint and the
steps only it restores are kept (``deck.ops.retention.plan._quarantine_holds``), found from a copy
of the lineage with the quarantine marks lifted.

A generated lineage (``deck.testing.synth_lineage.LineageSim``, records as the writers commit
them, in memory: no storage) of N trainer checkpoints, a full every 100 steps, a delta elsewhere;
then the delta 50 steps from the head quarantined (50 steps restore only through it). Printed per
N, medians of ``--repeats``: ``plan_lineage`` with the default policy without the quarantine and
with it, and the holds alone, with the growth exponent between the last two sizes. Only a GC run
over the whole store (``deck gc --whole``, every ``--gc-whole-every``-th ``deck merge --gc`` run)
plans the whole history; the default run plans the newest steps' folders.

    python benchmarks/investigations/bench_quarantine_holds.py [--sizes 1000,10000,100000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _timing import median_s

from deck.ops.retention.plan import RetentionPolicy, _quarantine_holds, plan_lineage
from deck.read.lineage import LineageGraph
from deck.testing.synth_lineage import LineageSim


def _lineages(n: int) -> tuple[LineageGraph, LineageGraph]:
    sim = LineageSim(seed=1)
    sim.save("full")
    for s in range(1, n):
        sim.train()
        sim.save("full" if s % 100 == 0 else "delta")
    plain = sim.graph()
    sim.quarantine(sim.trainer[n - 50].id)
    return plain, sim.graph()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    logging.disable(logging.WARNING)  # (each unrestorable step is said once per plan)
    policy = RetentionPolicy()
    rows = []
    for n in map(int, a.sizes.split(",")):
        plain, marked = _lineages(n)
        base = median_s(lambda: plan_lineage(plain, policy), a.repeats)  # noqa: B023
        with_q = median_s(lambda: plan_lineage(marked, policy), a.repeats)  # noqa: B023
        holds = median_s(lambda: _quarantine_holds(marked, None), a.repeats)  # noqa: B023
        held = len(plan_lineage(marked, policy).held)
        rows.append((n, base, with_q, holds))
        print(
            f"{n:>7} checkpoints: plan {base * 1e3:8.1f} ms; with a quarantine "
            f"{with_q * 1e3:8.1f} ms ({with_q / base:.2f}x); the holds alone {holds * 1e3:8.1f} "
            f"ms; {held} checkpoints held",
            flush=True,
        )
    if len(rows) > 1:
        (n0, _, q0, h0), (n1, _, q1, h1) = rows[-2], rows[-1]
        k = math.log(n1 / n0)
        print(
            f"growth {n0} -> {n1}: plan with a quarantine k={math.log(q1 / q0) / k:.2f}, "
            f"holds k={math.log(h1 / h0) / k:.2f}"
        )
    print(
        "reproduce: python "
        + " ".join(["benchmarks/investigations/bench_quarantine_holds.py", *sys.argv[1:]])
    )


if __name__ == "__main__":
    main()
