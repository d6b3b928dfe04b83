"""What a poll that finds nothing new costs a reader of published steps, as the history grows:
`deck follow` (:class:`deck.serve.follow.Follower`) and a live serving model's source
(:class:`deck.serve.live_source.PublishSource`), against the poll that reads every record (the
read from the last one, ``read_manifests(previous=...)``, the lineage graph of every record, the
latest step, the check of it against the records with the listing of the step folders above it,
its cheapest chain: what both did before they planned from the newest part of the history, as
a restore of the latest does). One store per size, generated as ``bench_history_scale.py`` does
(a trainer full every 100 steps, merger stride 4, 100 log entries after the catalog); the
readers hold the latest step (what one that served it holds; their output writing is not part
of a poll with nothing new); medians of ``--repeats``, with the storage requests of each.

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
from collections.abc import Callable
from functools import partial

import bench_history_scale as scale

from deck.read.catalog import ManifestSet, read_manifests
from deck.read.lineage import build_graph, cheapest_chain, confirmed
from deck.serve.follow import Follower
from deck.serve.live_source import PublishSource
from deck.storage import LocalStorage, Storage


def _every_record(store: Storage, last: ManifestSet) -> None:
    manifests = read_manifests(store, previous=last)
    latest = build_graph(manifests).latest()
    checked = confirmed(store, manifests, latest, latest=True)
    graph = build_graph(checked)
    latest = graph.latest()
    assert latest is not None
    cheapest_chain(graph, latest)


def _live_poll(source: PublishSource, held: tuple[int, str]) -> None:
    assert not source.next_plans(held, frozenset())


def _timed(counting: scale._Counting, repeats: int, poll: Callable[[], object]) -> list[float]:
    """Median seconds and requests (made through ``counting``) of ``poll``."""
    times, requests = [], []
    for _ in range(repeats):
        counting.n = 0
        t0 = time.perf_counter()
        poll()
        times.append(time.perf_counter() - t0)
        requests.append(counting.n)
    return [statistics.median(times), statistics.median(requests)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    gen = argparse.Namespace(
        stride=4, merger_full_every=64, lag=5, full_every=100, rollback_every=10000, behind=100
    )
    files = scale.writer_checkpoint()
    names = ("every record", "deck follow", "live source")
    rows: list[tuple[int, list[float]]] = []
    with tempfile.TemporaryDirectory() as work:
        for n in (int(x) for x in a.sizes.split(",")):
            sim = scale.generate(n, gen, files)
            store = LocalStorage(os.path.join(work, f"s{n}"))
            sim.write(store, durable=False)
            sim.write_log(store, gen.behind, scale._fast_put(store))
            last = read_manifests(store)
            graph = build_graph(last)
            latest = graph.latest()
            assert latest is not None
            held = cheapest_chain(graph, latest)[-1]

            # One reader of each kind, polled again and again as a running one is
            counting = [scale._Counting(store) for _ in names]
            follower = Follower(counting[1], os.path.join(work, f"out{n}"))
            follower.state, follower.epoch = held.state, held.epoch
            follower._outputs_level = lambda: None  # type: ignore[method-assign]
            source = PublishSource(counting[2])

            polls: list[Callable[[], object]] = [
                partial(_every_record, counting[0], last),
                follower.catch_up,
                partial(_live_poll, source, held.state),
            ]
            got = [
                x
                for c, poll in zip(counting, polls, strict=True)
                for x in _timed(c, a.repeats, poll)
            ]
            rows.append((n, got))
            print(
                f"{n}: "
                + ", ".join(
                    f"{name} {got[2 * i] * 1e3:.1f} ms / {got[2 * i + 1]:.0f} requests"
                    + (f" ({got[2 * i] / got[0]:.3f}x)" if i else "")
                    for i, name in enumerate(names)
                ),
                flush=True,
            )
    for (n0, r0), (n1, r1) in itertools.pairwise(rows):
        ks = [math.log(r1[2 * i] / r0[2 * i]) / math.log(n1 / n0) for i in range(len(names))]
        print(
            f"growth exponent {n0}->{n1}: "
            + ", ".join(f"{name} {k:.2f}" for name, k in zip(names, ks, strict=True))
        )
    print(
        f"reproduce: python benchmarks/bench_follow_poll.py --sizes {a.sizes} --repeats {a.repeats}"
    )


if __name__ == "__main__":
    main()
