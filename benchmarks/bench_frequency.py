"""Checkpoint frequency at equal training overhead: deck deltas vs blocking ``dcp.save``.

DECK's headline is "12x more frequent checkpoints at equal throughput cost". This measures the
same thing here, in one run and one process group: the 2-rank gloo DLRM of ``deck.demo``
(``--tables`` x ``--rows`` x ``--dim`` fp32, EXACT_ROWWISE_ADAGRAD, Zipf ids, ``--batch`` per
rank) trains windows of ``--window`` steps, each window in one mode:

- ``none``: no checkpoints;
- ``deck N``: a DeltaCheckpointer (tier ``local``, a fresh directory) taking a delta every N
  steps; its first full is taken and committed before the window starts (with
  ``--staging-mode process``, so is its staging process's start);
- ``dcp M``: a blocking ``torch.distributed.checkpoint.save`` of the model + dense optimizer
  state (the same state deck saves: TorchRec's ShardedTensors carry the fused optimizer's rows)
  every M steps, each into a fresh directory.

A window's time is the wall time of its ``--window`` steps on rank 0, checkpoint calls included,
and for deck also the final ``flush()`` (the last delta's background write is charged to the
window; conservative for deck). The modes run in a Williams order per repeat (``--repeats``), so
slow drifts on a shared machine hit every mode alike. Per repeat, a mode's throughput cost is
``window_time / window_time(none) - 1``; the table shows the median over repeats.

Cost is the checkpoint overhead amortised over the interval, so it is close to linear in the
frequency 1/interval. The interval each method achieves at an equal cost (``--costs``, in %) is
read off its measured (frequency, cost) points by linear interpolation (``interp``: between two
measured points; ``via 0``: between (0, 0) and the sparsest measured interval, i.e. cost taken
proportional to frequency there); where the target lies beyond the measured points it is taken
from a least-squares fit cost = c / interval and marked ``fit``. The ratio interval(dcp) / interval(deck) is the frequency ratio at equal cost.

    python benchmarks/bench_frequency.py                      # 8 x 100k x 64, a few minutes
    python benchmarks/bench_frequency.py --rows 1000000       # the full 2 GiB DLRM
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from deck.demo import ModelSpec, build_model, train_step
from deck.processes import end_rank, free_port, init_process_group

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

Mode = tuple[str, int]  # ("none", 0), ("deck", N), ("dcp", M)


def _quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)


Window = tuple[float, list[float], list[float]]  # wall s, checkpoint call s, train step s


def _train(model: Any, opt: Any, spec: ModelSpec, step: int, train_s: list[float]) -> None:
    t0 = time.perf_counter()
    train_step(model, opt, spec, step)
    train_s.append(time.perf_counter() - t0)


def _window_none(model: Any, opt: Any, spec: ModelSpec, s0: int, w: int) -> Window:
    train_s: list[float] = []
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(s0 + 1, s0 + w + 1):
        _train(model, opt, spec, step, train_s)
    dist.barrier()
    return time.perf_counter() - t0, [], train_s


def _window_deck(
    model: Any,
    opt: Any,
    spec: ModelSpec,
    s0: int,
    w: int,
    every: int,
    uri: str,
    staging_mode: str | None = None,
) -> Window:
    import deck
    from deck.config import StagingConfig

    mode = {"mode": staging_mode} if staging_mode else {}
    config = deck.DeckConfig(
        uri=uri, delta_every_steps=every, staging=StagingConfig(tiers="local", **mode)
    )
    train_s: list[float] = []
    calls: list[float] = []
    with deck.enable(model, [opt], config) as ckpt:
        ckpt.save("full", step=s0)
        ckpt.flush()  # the full is setup, not part of the window
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(s0 + 1, s0 + w + 1):
            _train(model, opt, spec, step, train_s)
            t1 = time.perf_counter()
            ckpt.step(step)
            if step % every == 0:
                calls.append(time.perf_counter() - t1)
        t1 = time.perf_counter()
        ckpt.flush()  # the last delta's background write is charged to the window
        calls[-1] += time.perf_counter() - t1
        dist.barrier()
        dt = time.perf_counter() - t0
        # rank 0 commits; the other ranks' parts end "uploaded"
        bad = [h for h in ckpt.history if h.state == "failed" or h.error]
        if bad:
            raise RuntimeError(f"deck checkpoint not committed: {bad[0].state} {bad[0].error}")
    return dt, calls, train_s


def _window_dcp(
    model: Any, opt: Any, spec: ModelSpec, s0: int, w: int, every: int, root: str
) -> Window:
    import torch.distributed.checkpoint as dcp

    train_s: list[float] = []
    calls: list[float] = []
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(s0 + 1, s0 + w + 1):
        _train(model, opt, spec, step, train_s)
        if step % every == 0:
            t1 = time.perf_counter()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.save(state, checkpoint_id=os.path.join(root, f"step-{step}"))
            calls.append(time.perf_counter() - t1)
    dist.barrier()
    return time.perf_counter() - t0, calls, train_s


def _worker(
    rank: int, world_size: int, port: int, a: argparse.Namespace, modes: list[Mode]
) -> None:
    _quiet()
    from _workload import williams_order

    init_process_group(rank, world_size, port)
    spec = ModelSpec(num_tables=a.tables, rows=a.rows, dim=a.dim, batch=a.batch)
    model, opt = build_model(spec)
    s0 = 0
    for _ in range(a.warmup):
        s0 += 1
        train_step(model, opt, spec, s0)
    s0 = a.window * (s0 // a.window + 1)
    runs: list[dict[str, Any]] = []
    for rep in range(a.repeats):
        for mi in williams_order(len(modes), rep):
            kind, every = modes[mi]
            scratch = os.path.join(a.out, f"{kind}-{every}-{rep}")
            if kind == "none":
                dt, calls, train_s = _window_none(model, opt, spec, s0, a.window)
            elif kind == "deck":
                dt, calls, train_s = _window_deck(
                    model, opt, spec, s0, a.window, every, scratch, a.staging_mode
                )
            else:
                dt, calls, train_s = _window_dcp(model, opt, spec, s0, a.window, every, scratch)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(scratch, ignore_errors=True)
            runs.append(
                {
                    "rep": rep,
                    "kind": kind,
                    "every": every,
                    "s": dt,
                    "ckpt_s": calls,
                    "train_s": train_s,
                }
            )
            s0 += a.window
    if rank == 0:
        with open(os.path.join(a.results, "rank0.json"), "w") as f:
            json.dump(runs, f)
    dist.barrier()
    end_rank()


def _interval_at(points: list[tuple[int, float]], target: float) -> tuple[float, str]:
    """The interval (steps) at which the cost curve reaches ``target``: linear interpolation in
    frequency over the measured (interval, cost) points and (inf, 0), else a fit c / interval."""
    pts = sorted((1 / n, c) for n, c in points)  # by frequency, ascending
    curve = [(0.0, 0.0), *pts]
    for i, ((f0, c0), (f1, c1)) in enumerate(itertools.pairwise(curve)):
        if c0 < target <= c1:
            f = f0 + (target - c0) * (f1 - f0) / (c1 - c0)
            return 1 / f, "interp" if i else "via 0"
    c = sum(f * cost for f, cost in pts) / sum(f * f for f, _ in pts)
    if c <= 0:
        return math.nan, "fit"
    return c / target, "fit"


def _excess(r: dict[str, Any]) -> float:
    """The window's time beyond its own median training step, as a fraction of W x that median:
    checkpoint calls, the final flush, and steps slowed by background work, but not a shift in
    the machine's load between windows (which the median absorbs)."""
    med = statistics.median(r["train_s"])
    return (sum(r["train_s"]) + sum(r["ckpt_s"])) / (len(r["train_s"]) * med) - 1


def _staging_mode(a: argparse.Namespace) -> str:
    """The StagingConfig.mode deck's checkpointers run with."""
    from deck.config import StagingConfig

    return a.staging_mode or StagingConfig().mode


def _report(a: argparse.Namespace, runs: list[dict[str, Any]], modes: list[Mode]) -> None:
    nones = {r["rep"]: r for r in runs if r["kind"] == "none"}
    model_bytes = a.tables * a.rows * (a.dim * 4 + 4)
    print(
        f"DLRM {a.tables} tables x {a.rows} rows x {a.dim} dim fp32 + rowwise momentum "
        f"({model_bytes / 2**20:.0f} MiB), EXACT_ROWWISE_ADAGRAD, Zipf ids, batch {a.batch}/rank, "
        f"2 gloo ranks (1 thread each), windows of {a.window} steps, {a.repeats} repeats "
        f"(Williams order), deck tier local, staging mode {_staging_mode(a)}; machine: "
        f"{os.cpu_count()} cores"
    )
    step_ms = statistics.median(statistics.median(r["train_s"]) for r in nones.values()) * 1e3
    print(f"no checkpoints: median step {step_ms:.1f} ms")
    print()
    print(
        "cost = excess of the window over its own median step, minus the same of the repeat's "
        "no-checkpoint window; wall = window wall time / no-checkpoint window - 1; "
        "step = median train step / no-checkpoint one - 1 (all medians over repeats, %)"
    )
    print(
        f"{'method':<6} {'interval':>8} {'ckpts':>6} {'cost %':>7} {'per repeat':>20} "
        f"{'wall %':>7} {'step %':>7} {'median ckpt call s':>19}"
    )
    curves: dict[str, list[tuple[int, float]]] = {"deck": [], "dcp": []}
    walls: dict[str, list[tuple[int, float]]] = {"deck": [], "dcp": []}
    for kind, every in modes:
        rs = [r for r in runs if r["kind"] == kind and r["every"] == every]
        costs = [_excess(r) - _excess(nones[r["rep"]]) for r in rs]
        cost = statistics.median(costs)
        wall = statistics.median(r["s"] / nones[r["rep"]]["s"] - 1 for r in rs)
        slow = statistics.median(
            statistics.median(r["train_s"]) / statistics.median(nones[r["rep"]]["train_s"]) - 1
            for r in rs
        )
        calls = [x for r in rs for x in r["ckpt_s"]]
        call = f"{statistics.median(calls):.3f}" if calls else "-"
        nck = a.window // every if every else 0
        print(
            f"{kind:<6} {every or '-':>8} {nck:>6} {cost * 100:>7.2f} "
            f"{' '.join(f'{c * 100:.1f}' for c in costs):>20} {wall * 100:>7.1f} "
            f"{slow * 100:>7.1f} {call:>19}"
        )
        if kind != "none":
            curves[kind].append((every, cost))
            walls[kind].append((every, wall))
    print()
    fit = {
        k: sum(c / n for n, c in v) / sum(1 / n**2 for n, _ in v) * step_ms
        for k, v in curves.items()
        if v
    }
    print(
        "per-checkpoint overhead from the fit cost = c / interval: "
        + ", ".join(f"{k} {ms:.0f} ms" for k, ms in fit.items())
        + (
            f"; ratio dcp/deck {fit['dcp'] / fit['deck']:.1f} (the frequency ratio at any equal "
            "cost if both curves were exactly c / interval)"
            if fit.get("deck", 0) > 0 and "dcp" in fit
            else ""
        )
    )
    print()
    print(
        f"{'equal cost':>10} {'deck interval':>17} {'dcp interval':>17} {'ratio dcp/deck':>15} "
        f"{'(from wall %)':>14}"
    )
    for target in a.costs:
        nd, how_d = _interval_at(curves["deck"], target / 100)
        nc, how_c = _interval_at(curves["dcp"], target / 100)
        wd, _ = _interval_at(walls["deck"], target / 100)
        wc, _ = _interval_at(walls["dcp"], target / 100)
        print(
            f"{target:>9.1f}% {nd:>9.1f} ({how_d:>6}) {nc:>9.1f} ({how_c:>6}) {nc / nd:>15.1f} "
            f"{wc / wd:>14.1f}"
        )
    print(
        "(ratio = interval dcp / interval deck: how many times more often deck checkpoints at the "
        "same throughput cost)"
    )
    print()
    print("reproduce: " + " ".join([os.path.relpath(sys.executable), *sys.argv]))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000, help="rows per table (full size: 1000000)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--window", type=int, default=100, help="steps per measured window")
    p.add_argument("--deck-every", type=int, nargs="+", default=[50, 20, 10, 5, 2])
    p.add_argument("--dcp-every", type=int, nargs="+", default=[100, 50, 20])
    p.add_argument("--costs", type=float, nargs="+", default=[2.0, 4.0], help="equal cost, %%")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument(
        "--staging-mode",
        choices=["threads", "process"],
        default=None,
        help="StagingConfig.mode of deck's checkpointers (default: the config's default, "
        "$DECK_STAGING_MODE or threads)",
    )
    a = p.parse_args()
    for n in [*a.deck_every, *a.dcp_every]:
        if a.window % n:
            p.error(f"--window ({a.window}) must be a multiple of every interval ({n})")
    modes: list[Mode] = [("none", 0)]
    modes += [("deck", n) for n in a.deck_every] + [("dcp", m) for m in a.dcp_every]
    work = a.workdir or tempfile.mkdtemp(prefix="deck-bench-frequency-", dir="/tmp")
    a.out = os.path.join(work, "out")
    a.results = os.path.join(work, "results")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.results, exist_ok=True)
    try:
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(2, free_port(), a, modes), nprocs=2, join=True)
        with open(os.path.join(a.results, "rank0.json")) as f:
            runs = json.load(f)
        print(f"(run took {time.perf_counter() - t0:.0f} s)")
        _report(a, runs, modes)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
