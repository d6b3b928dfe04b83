"""Recovery after N deltas since the trainer's last full: through the merger's lineage vs loading
one full checkpoint of the same state vs naive replay (the full, then every delta).

DECK's example: a full every 4 hours, a delta every 5 minutes, so up to 47 deltas to replay. The
trainer writes a full, then ``--deltas`` deltas of the Zipf DLRM workload (benchmarks/_workload.py:
the demo's embedding tables as plain tensors, the real writer and on-disk format). A merger worker
(default policy: stride 4, new full when the live chain passes 10% of a full) runs after every
delta, as ``deck merge --follow`` would. Then, in one run:

- ``merger``: restore the newest step through its cheapest chain (what ``restore()`` does);
- ``merger, merged deltas only``: the same deltas merged with no new fulls (``--full-live-fraction 0``);
- ``one full``: a full checkpoint of the same state, written separately;
- ``naive replay``: the trainer's full and all N deltas (parent links only).

Each restore applies the chain into freshly allocated tables (one process, all ranks' tables),
is checked bitwise against the live state, and is repeated in rounds over all strategies; the
table shows medians. Before each timed restore the chain's files are evicted from the page cache
(``--cache cold``, default: a restarted job reads them from the disk) or read into it (``--cache
warm``: times are CPU / memory bound); bytes read are what a cold restore fetches.

    python benchmarks/bench_recovery.py [--deltas 47] [--rows 100000] [--dim 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
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
    warm_cache,
)

from deck.format.manifest import CheckpointManifest
from deck.merge.policy import FullPolicy, MergeConfig
from deck.merge.worker import MergeWorker
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.storage import LocalStorage


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def chain_files(storage: LocalStorage, chain: list[CheckpointManifest]) -> list[str]:
    """Every file of ``chain``'s checkpoint folders."""
    return [
        os.path.join(folder, name)
        for m in chain
        for folder, _, names in os.walk(storage.local_path(m.folder))
        for name in names
    ]


def main(argv: list[str] | None = None) -> int:
    # One compute thread, like each rank of the demo: on a small shared box, OpenMP threads
    # waiting for a busy core turn every tensor copy into a scheduler tick.
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--deltas", type=int, default=47)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--live-fraction", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=26.0, help="training step time (demo DLRM)")
    p.add_argument(
        "--cache",
        choices=("warm", "cold"),
        default="cold",
        help="before each timed restore, evict the chain's files from the page cache (cold, "
        "default: a restarted job reads them from the disk) or read them into it (warm: CPU / "
        "memory bound)",
    )
    p.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    a = p.parse_args(argv)
    w = Workload(tables=a.tables, rows=a.rows, dim=a.dim)
    return in_workdir(a.out, "deck-bench-recovery-", lambda work: _run(a, w, work))


def _run(a: argparse.Namespace, w: Workload, work: str) -> int:
    uri = os.path.join(work, "run")
    storage = LocalStorage(uri)
    tr = ZipfTrainer(w, storage)
    print(f"workload: {w.describe()}; {a.deltas} deltas after one full", flush=True)
    tr.save("full")
    cfg = MergeConfig(stride=a.stride, full=FullPolicy(max_live_fraction=a.live_fraction))
    worker = MergeWorker(storage, cfg)
    write_s, merge_s, delta_bytes = [], [], []
    for _ in range(a.deltas):
        tr.interval()
        t0 = time.perf_counter()
        m = tr.save()
        write_s.append(time.perf_counter() - t0)
        delta_bytes.append(m.data_bytes)
        t0 = time.perf_counter()
        worker.run_once()
        merge_s.append(time.perf_counter() - t0)
    live = tr.live()
    latest = tr.step

    # The same trainer checkpoints, merged deltas only (hard links: files are never rewritten).
    only = os.path.join(work, "merged-only")
    shutil.copytree(
        uri,
        only,
        copy_function=os.link,
        ignore=lambda d, names: ["merged"] if os.path.abspath(d) == os.path.abspath(uri) else [],
    )
    only_storage = LocalStorage(only)
    t0 = time.perf_counter()
    MergeWorker(
        only_storage,
        MergeConfig(stride=a.stride, full=FullPolicy(every=None, max_live_fraction=None)),
    ).run_once()
    only_merge_s = time.perf_counter() - t0

    full_storage = LocalStorage(os.path.join(work, "full"))
    full_m = tr.save("full", storage=full_storage)

    manifests = read_manifests(storage)
    strategies = {
        f"merger (s={a.stride}, live<={a.live_fraction:g})": (
            storage,
            chain_for(manifests, latest),
        ),
        "merger, merged deltas only": (
            only_storage,
            chain_for(read_manifests(only_storage), latest),
        ),
        "one full of the same state": (full_storage, [full_m]),
        "naive replay (full + every delta)": (storage, chain_for(dict(manifests), latest)),
    }
    # Rounds over all strategies (not one strategy after the other), so that machine noise
    # hits every strategy alike.
    times: dict[str, list[float]] = {name: [] for name in strategies}
    read: dict[str, int] = {}
    for _ in range(a.repeats):
        for name, (st, chain) in strategies.items():
            # Whichever way the files were written (the merger's and the stager's chunks
            # bypass the page cache), every strategy starts from the same cache state.
            (drop_cache if a.cache == "cold" else warm_cache)(chain_files(st, chain))
            dt, state, read[name] = restore_into_fresh(st, chain, w)
            if not bitwise_equal(state, live):
                raise SystemExit(f"{name}: restored state differs from the live state")
            times[name].append(dt)
            del state
    rows = [
        (name, chain, read[name], statistics.median(times[name]))
        for name, (_, chain) in strategies.items()
    ]
    full_t = rows[2][3]
    naive_t = rows[3][3]
    print()
    print(
        f"{'strategy':<36} {'ckpts':>5} {'bytes read':>13} {'median s':>9} "
        f"{'vs full':>8} {'naive /':>8}"
    )
    for name, chain, read, t in rows:
        print(
            f"{name:<36} {len(chain):>5} {_mib(read):>13} {t:>9.3f} {t / full_t:>7.2f}x "
            f"{naive_t / t:>7.2f}x"
        )
    m_chain = rows[0][1]
    print()
    print(
        "merger chain: "
        + " + ".join(f"{m.kind.value}[{m.covers[0]}..{m.covers[1]}]" for m in m_chain)
    )
    fulls = sum(1 for m in manifests.merged.values() if m.kind.value == "full")
    interval_s = w.steps_per_delta * a.step_ms / 1000
    print(
        f"merger: {fulls} new full(s) in {a.deltas} deltas; {statistics.median(merge_s):.3f} s median / "
        f"{sum(merge_s) / len(merge_s):.3f} s mean per delta (all layers and fulls), "
        f"merged-deltas-only pass {only_merge_s:.2f} s for {a.deltas} deltas "
        f"({only_merge_s / a.deltas:.3f} s per delta)"
    )
    print(
        f"trainer: delta {_mib(statistics.median(delta_bytes))} median, written in "
        f"{statistics.median(write_s):.3f} s; one interval = {w.steps_per_delta} steps x "
        f"{a.step_ms:.0f} ms = {interval_s:.2f} s -> merge velocity (interval / merge time per "
        f"delta): {interval_s / (sum(merge_s) / len(merge_s)):.2f}x with new fulls, "
        f"{interval_s / (only_merge_s / a.deltas):.2f}x merged deltas only"
    )
    ok_full = rows[0][3] <= 1.3 * full_t
    ok_naive = naive_t >= 6 * rows[0][3]
    print(
        f"goals: merger <= 1.3x one full: {'met' if ok_full else 'NOT met'} "
        f"({rows[0][3] / full_t:.2f}x in time, {rows[0][2] / rows[2][2]:.2f}x in bytes); "
        f">= 6x faster than naive replay: {'met' if ok_naive else 'NOT met'} "
        f"({naive_t / rows[0][3]:.2f}x)"
    )
    print("reproduce: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
