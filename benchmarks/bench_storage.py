"""Storage after N checkpoint intervals of the Zipf DLRM workload: deck (deltas + merger + GC)
vs a faithful Check-N-Run differential strategy vs a full checkpoint every interval.

One run of the workload (benchmarks/_workload.py: the demo's embedding tables as plain tensors,
written with the real writer and format) drives all three strategies:

- **deck**: the trainer writes a full, then a delta per interval; a merger worker (default policy:
  stride 4, new full when the live chain passes 10% of a full) and GC run after every interval,
  as ``deck merge --follow --gc`` would. Storage is every byte under the URI at the end.
- **Check-N-Run** (Eisenman et al., NSDI'22; the differential strategy IncrCP compares with):
  each checkpoint holds every row touched since its baseline full; a new baseline is taken when
  the differential would exceed ``--cnr-reset`` of a full (its baseline reset). Its checkpoints
  are written in deck's format (a diff is a delta whose parent is the baseline) and measured.
- **full every interval**: every checkpoint a full (its size is the same every time).

Storage is compared for the same set of restorable steps:

- *default retention* (``deck gc``: every step stays restorable; IncrCP's accounting): all N + 1
  checkpoints stay restorable under each strategy;
- *bounded retention* (``deck gc --no-keep-all-steps``, DECK fig. 9: the newest 2 fulls and the
  active window): deck keeps those steps; Check-N-Run and full-every-interval keep what
  restoring the same steps needs.

    python benchmarks/bench_storage.py [--intervals 150] [--rows 100000] [--dim 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _workload import Workload, ZipfTrainer, in_workdir, tree_bytes

from deck.format.manifest import MANIFEST
from deck.merge.policy import FullPolicy, MergeConfig
from deck.merge.worker import MergeWorker
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph
from deck.storage import LocalStorage


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    # One compute thread, like each rank of the demo: on a small shared box, OpenMP threads
    # waiting for a busy core turn every tensor copy into a scheduler tick.
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--intervals", type=int, default=150)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--live-fraction", type=float, default=0.1)
    p.add_argument(
        "--chain-delta-budget",
        type=float,
        default=RetentionPolicy.model_fields["chain_delta_budget"].default,
        help="deck gc --chain-delta-budget (0: off)",
    )
    p.add_argument("--cnr-reset", type=float, default=0.5, help="Check-N-Run baseline reset")
    p.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    a = p.parse_args(argv)
    w = Workload(tables=a.tables, rows=a.rows, dim=a.dim)
    return in_workdir(a.out, "deck-bench-storage-", lambda work: _run(a, w, work))


def _run(a: argparse.Namespace, w: Workload, work: str) -> int:
    t_start = time.perf_counter()
    uri = os.path.join(work, "deck")
    storage = LocalStorage(uri)
    cnr_storage = LocalStorage(os.path.join(work, "cnr"))
    tr = ZipfTrainer(w, storage)
    print(f"workload: {w.describe()}; {a.intervals} intervals", flush=True)
    first = tr.save("full")
    full_bytes = first.data_bytes
    worker = MergeWorker(
        storage, MergeConfig(stride=a.stride, full=FullPolicy(max_live_fraction=a.live_fraction))
    )
    default = RetentionPolicy(chain_delta_budget=a.chain_delta_budget or None, grace_s=0)
    # Check-N-Run: its own baseline, and the union of rows touched since it, per table.
    cnr_base = first.step
    cnr_base_id = first.id
    cnr_union = [torch.zeros(w.rows, dtype=torch.bool) for _ in range(w.tables)]
    cnr_sizes: dict[int, tuple[int, int]] = {first.step: (first.step, full_bytes)}
    cnr_fulls = 1
    steps = [first.step]
    for i in range(a.intervals):
        touched = tr.interval()
        tr.save()
        worker.run_once()
        collect_garbage(storage, default)
        steps.append(tr.step)
        # Check-N-Run's checkpoint of this interval.
        for u, rows in zip(cnr_union, touched, strict=True):
            u[rows] = True
        frac = sum(int(u.sum()) for u in cnr_union) / (w.rows * w.tables)
        if frac > a.cnr_reset:
            m = tr.save("full", storage=cnr_storage, rows=None, parent=None)
            cnr_base, cnr_base_id, cnr_fulls = tr.step, m.id, cnr_fulls + 1
            for u in cnr_union:
                u.zero_()
        else:
            m = tr.save(
                "delta",
                storage=cnr_storage,
                rows=lambda t, _s: torch.nonzero(cnr_union[t]).view(-1),
                parent=(cnr_base, cnr_base_id),
            )
        size = m.data_bytes + cnr_storage.size(f"{m.folder}/{MANIFEST}")
        cnr_sizes[tr.step] = (cnr_base if m.kind.value == "delta" else tr.step, size)
        cnr_storage.delete_prefix(f"{m.folder}/")  # measured; the bytes are accounted below
        if (i + 1) % 25 == 0:
            print(f"  interval {i + 1}: deck {_mib(tree_bytes(uri))}", flush=True)

    full_size = full_bytes + storage.size(f"step-{0:012d}/{MANIFEST}")
    # Default retention: every step restorable.
    deck_all = tree_bytes(uri)
    all_steps = build_graph(read_manifests(storage)).restorable_steps()
    assert all_steps == steps, "deck lost a step under the default retention"
    graph = build_graph(read_manifests(storage))
    chain_fulls = sorted(sum(m.data_bytes for m in graph.chain(s)) / full_bytes for s in steps)
    cnr_fulls_read = sorted(
        (size + (cnr_sizes[base][1] if base != s else 0)) / full_bytes
        for s, (base, size) in cnr_sizes.items()
    )
    cnr_all = sum(size for _, size in cnr_sizes.values())
    full_all = len(steps) * full_size
    # Bounded retention: apply it now (what running it all along would have kept).
    rep = collect_garbage(storage, RetentionPolicy(keep_all_steps=False, grace_s=0))
    deck_bounded = tree_bytes(uri)
    kept = rep.retained_steps
    bases = {cnr_sizes[s][0] for s in kept}
    cnr_bounded = sum(cnr_sizes[s][1] for s in kept) + sum(
        cnr_sizes[b][1] for b in bases if b not in kept
    )
    full_bounded = len(kept) * full_size
    merger_fulls = sum(1 for m in read_manifests(storage).merged.values() if m.kind.value == "full")

    print()
    print(f"one full checkpoint: {_mib(full_size)}; Check-N-Run took {cnr_fulls} full(s)")
    print(
        f"{'retention':<26} {'restorable':>10} {'deck':>10} {'Check-N-Run':>12} "
        f"{'full/interval':>14} {'deck/CNR':>9} {'deck/full':>10}"
    )
    for name, n, d, c, f in (
        ("default (every step)", len(steps), deck_all, cnr_all, full_all),
        ("bounded (DECK fig. 9)", len(kept), deck_bounded, cnr_bounded, full_bounded),
    ):
        print(
            f"{name:<26} {n:>10} {_mib(d):>10} {_mib(c):>12} {_mib(f):>14} "
            f"{d / c:>8.1%} {d / f:>9.1%}"
        )
    print(
        f"default retention: restoring a past step reads {statistics.median(chain_fulls):.2f} "
        f"fulls' bytes (median; at most {chain_fulls[-1]:.2f}) through its cheapest chain; "
        f"Check-N-Run {statistics.median(cnr_fulls_read):.2f} (at most {cnr_fulls_read[-1]:.2f})"
    )
    print(f"bounded retention keeps steps {kept} ({merger_fulls} merger full(s) left)")
    print(
        f"goal deck <= 40% of Check-N-Run under default retention: "
        f"{'met' if deck_all <= 0.4 * cnr_all else 'NOT met'} ({deck_all / cnr_all:.1%}; "
        f"{deck_all / full_all:.1%} of a full every interval); bounded retention, same steps: "
        f"{deck_bounded / cnr_bounded:.1%}"
    )
    print(f"ran in {time.perf_counter() - t_start:.0f} s")
    print("reproduce: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
