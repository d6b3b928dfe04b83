"""What `deck verify --all` spends finding the full each checkpoint's chain starts from (the tables
it checks every later checkpoint against), as the history grows: ``LineageGraph.full_below``
asked of every checkpoint of an in-memory lineage (a trainer full every ``--full-every`` steps,
deltas between), against the walk without memory (each checkpoint's parent links followed down
to its full: what it did first, N x the full interval). Reads nothing: the graph is the records
verify reads anyway. Medians of ``--repeats``; the growth exponent k between the last two sizes.

    python benchmarks/bench_verify_walk.py [--sizes 1000,10000,100000] [--full-every 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from deck.format.manifest import FORMAT_VERSION, CheckpointManifest, Kind, RankRef
from deck.read.lineage import LineageGraph


def lineage(n: int, every: int) -> dict[int, CheckpointManifest]:
    """``n`` trainer checkpoints: a full every ``every`` steps, each other one a delta."""
    out: dict[int, CheckpointManifest] = {}
    parent, base = (0, ""), 0
    for step in range(n):
        cid = f"{step + 1:016x}"
        full = step % every == 0
        base = step if full else base
        ref = RankRef(rank=0, path=f"{cid}/rank-00000.json", nbytes=1, checksum="0", data_bytes=1)
        out[step] = CheckpointManifest(
            format_version=FORMAT_VERSION,
            id=cid,
            step=step,
            kind=Kind.FULL if full else Kind.DELTA,
            parent=None if full else parent[0],
            parent_id=None if full else parent[1],
            base=base,
            epoch=0,
            world_size=1,
            ranks=(ref,),
            created_unix=0.0,
            deck_version="bench",
        )
        parent = (step, cid)
    return out


def walk_without_memory(graph: LineageGraph, node_id: str) -> str | None:
    """The baseline: parent links followed down to the full, nothing kept."""
    node = graph.nodes.get(node_id)
    while node is not None and node.kind is not Kind.FULL:
        below = graph.parents(node.id)
        node = below[0] if below else None
    return None if node is None else node.id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--full-every", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    print("reproduce: python " + " ".join(sys.argv))
    times: dict[str, list[float]] = {"full_below": [], "walk without memory": []}
    for n in sizes:
        ms = lineage(n, a.full_every)
        for name, ask in (
            ("full_below", lambda g, i: g.full_below(i)),
            ("walk without memory", walk_without_memory),
        ):
            runs = []
            for _ in range(a.repeats):
                graph = LineageGraph(ms)  # (a fresh graph: full_below's memory is per graph)
                t0 = time.perf_counter()
                for m in ms.values():
                    ask(graph, m.id)
                runs.append(time.perf_counter() - t0)
            times[name].append(statistics.median(runs))
        ratio = times["walk without memory"][-1] / max(times["full_below"][-1], 1e-9)
        print(
            f"{n:>8} checkpoints: full_below {times['full_below'][-1]:.3f} s, walk without "
            f"memory {times['walk without memory'][-1]:.3f} s ({ratio:.1f}x)"
        )
    if len(sizes) > 1:
        for name, ts in times.items():
            k = math.log(ts[-1] / ts[-2]) / math.log(sizes[-1] / sizes[-2])
            print(f"growth exponent k {sizes[-2]}->{sizes[-1]}, {name}: {k:.2f}")


if __name__ == "__main__":
    main()
