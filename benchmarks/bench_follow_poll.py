"""What a `deck follow` poll that finds nothing new reads, as the history grows: the read from
the follower's last one (``read_manifests(previous=...)``) and the check of what it would serve
against the records (``confirmed``), without (``latest=False``, the follower before it listed
the step folders above the step it serves) and with (``latest=True``, now, as a restore of the
latest does) that listing. One store per size, generated as ``bench_history_scale.py`` does (a
trainer full every 100 steps, merger stride 4, 100 log entries after the catalog); medians.

    python benchmarks/bench_follow_poll.py [--sizes 1000,10000,100000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import tempfile
import time

import bench_history_scale as scale

from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph, confirmed
from deck.storage import LocalStorage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    gen = argparse.Namespace(
        stride=4, merger_full_every=64, lag=5, full_every=100, rollback_every=10000, behind=100
    )
    files = scale.writer_checkpoint()
    rows: list[tuple[int, float, float, float, float]] = []
    with tempfile.TemporaryDirectory() as work:
        for n in (int(x) for x in a.sizes.split(",")):
            sim = scale.generate(n, gen, files)
            store = LocalStorage(os.path.join(work, f"s{n}"))
            sim.write(store, durable=False)
            sim.write_log(store, gen.behind, scale._fast_put(store))
            last = read_manifests(store)
            latest = build_graph(last).latest()
            got = []
            for flag in (False, True):
                times, requests = [], []
                for _ in range(a.repeats):
                    counting = scale._Counting(store)
                    t0 = time.perf_counter()
                    confirmed(
                        counting, read_manifests(counting, previous=last), latest, latest=flag
                    )
                    times.append(time.perf_counter() - t0)
                    requests.append(counting.n)
                got += [statistics.median(times), statistics.median(requests)]
            rows.append((n, *got))
            print(
                f"{n}: before {got[0] * 1e3:.1f} ms / {got[1]:.0f} requests, now "
                f"{got[2] * 1e3:.1f} ms / {got[3]:.0f} requests ({got[2] / got[0]:.2f}x)",
                flush=True,
            )
    for (n0, *r0), (n1, *r1) in itertools.pairwise(rows):
        k = math.log(r1[2] / r0[2]) / math.log(n1 / n0)
        print(f"growth exponent {n0}->{n1} (now): {k:.2f}")
    print(
        f"reproduce: python benchmarks/bench_follow_poll.py --sizes {a.sizes} --repeats {a.repeats}"
    )


if __name__ == "__main__":
    main()
