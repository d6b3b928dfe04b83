"""End-to-end cost of tracking: steps/s of the 2-rank gloo DLRM with no tracking, with deck's
hooks (tracking, and the watch of dense gradients no optimizer step applied), and with TorchRec's
ModelDeltaTracker(auto_compact=True), in one run.

Windows of each mode are interleaved (A B C A B C ...) so machine noise hits all modes alike;
the median step time per mode is reported with ratios to no tracking.

    python benchmarks/bench_tracking_e2e.py [--rows 1000000] [--rounds 5] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp

from deck.demo import ModelSpec, build_model, train_step
from deck.processes import end_rank, free_port, init_process_group
from deck.trainer.tracker import TrackerStore


def _worker(rank: int, world_size: int, port: int, a: argparse.Namespace, out: str) -> None:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    init_process_group(rank, world_size, port)
    from deck.adapters.torchrec import TorchRecAdapter
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec

    spec = ModelSpec(num_tables=a.tables, rows=a.rows, dim=a.dim, batch=a.batch)
    model, opt = build_model(spec)
    adapter = TorchRecAdapter(model)
    shards = adapter.table_shards()
    modules = list(adapter.sharded_modules().values())
    times: dict[str, list[float]] = {"none": [], "deck": [], "torchrec": []}
    step = 0
    for _ in range(a.warmup):
        step += 1
        train_step(model, opt, spec, step)
    for _ in range(a.rounds):
        for mode in ("none", "deck", "torchrec"):
            handle = grads = trec = None
            if mode == "deck":
                store = TrackerStore(sum(s.rows for s in shards), ("checkpoint",))
                handle = adapter.install_tracking(store, shards, lambda m: True)
                # (and the watch of gradients no optimizer step applied: a hook per dense
                # parameter in every backward)
                grads = adapter.watch_gradients(adapter.optimizers([opt]))
            elif mode == "torchrec":
                trec = ModelDeltaTrackerTrec(model, auto_compact=True)
            for _ in range(a.steps):
                step += 1
                dist.barrier()
                t0 = time.perf_counter()
                train_step(model, opt, spec, step)
                if trec is not None:
                    trec.step()
                times[mode].append(time.perf_counter() - t0)
            if handle is not None:
                handle.remove()
            if grads is not None:
                grads.remove()
            for m in modules:
                m.post_lookup_tracker_fn = None
                m.post_odist_tracker_fn = None
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.barrier()
    end_rank()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    a = p.parse_args()
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    mp.spawn(_worker, args=(2, free_port(), a, out), nprocs=2)
    with open(out) as f:
        times = json.load(f)
    os.unlink(out)
    base = statistics.median(times["none"])
    print(
        f"DLRM {a.tables} tables x {a.rows} rows x {a.dim} dim, batch {a.batch}/rank, 2 gloo ranks, "
        f"{a.rounds} interleaved rounds x {a.steps} steps per mode"
    )
    print(f"{'mode':<10} {'median step ms':>15} {'steps/s':>9} {'vs none':>9}")
    for mode, ts in times.items():
        med = statistics.median(ts)
        print(f"{mode:<10} {med * 1e3:>15.2f} {1 / med:>9.2f} {med / base:>8.3f}x")
    print("reproduce: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
