"""Training stall per delta checkpoint vs a blocking ``torch.distributed.checkpoint.save``.

The 2-rank gloo DLRM of ``deck.demo`` (default 8 tables x 1M rows x 64 dim fp32, about 2 GiB of
weights, EXACT_ROWWISE_ADAGRAD), Zipf ids (``deck.demo.make_batch``), batch 1024 per rank. In one
run, for each target:

- ``local``: a DeltaCheckpointer writing to a directory under /tmp (tier ``local``);
- ``s3`` (with ``--s3``): a SeaweedFS server started by this script, tier ``cpu-ssd-remote``
  with a spool directory under /tmp;

the model trains ``--steps`` steps with a full checkpoint first and a delta every
``--delta-every`` steps. Per checkpoint: ``stall_s`` (what ``ckpt.step`` returned), bytes,
rows, and after ``ckpt.flush()`` the background ``durable_local_s`` / ``committed_s``. Then, in
the same processes, ``dcp.save({"model": model.state_dict(), "optim": dense_opt.state_dict()})``
is timed ``--dcp-repeats`` times (median), and ``dcp.async_save`` is tried once (its error is
printed: on this stack it cannot stage TorchRec's ShardedTensors).

By default training goes on while the first full checkpoint is still being fsynced/uploaded, as
a real job does (on S3 the deltas then queue behind the 2 GiB upload and share the CPU with it);
Before each delta the pure gather of the same rows (every state of every touched row
``index_select``-ed into one preallocated buffer, read from the tracker without consuming it) is
timed too, so each delta's stall is also reported as a multiple of that floor (the stall's goal:
goal stall <= 1.5x the gather and <= 1/50 of ``dcp.save``; ``--no-gather`` skips it).

Per interval of ``--delta-every`` steps each rank's CPU is accounted for by thread (Linux
schedstat): the training thread's CPU and run-queue wait, each background thread's CPU by name;
and the training thread's own CPU per step after a delta vs away from checkpoints. The same for
the no-deck baseline phase (a plain O_DIRECT writer of each delta's bytes; ``--no-plain-writes``
skips it).

``--settle`` waits for the full to commit first, so the deltas show the steady state.
``--staging-mode process`` runs deck's background work in a staging process per rank
(``StagingConfig.mode``; default: the config's, ``$DECK_STAGING_MODE`` or threads).
``--server-nice 19`` runs the co-located SeaweedFS server at the lowest CPU priority, standing in
for object storage on other machines (in production the S3 server does not share the trainer's
cores).

    python benchmarks/bench_stall.py [--s3] [--settle] [--server-nice 19] [--rows 1000000] [--steps 300] [--delta-every 50]
    python benchmarks/bench_stall.py --quick          # 100k rows, 100 steps, a delta every 25
    python benchmarks/bench_stall.py --steps 100 --delta-every 25 --release in_memory --runs 5
                                                      # the median over 5 whole runs
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from deck.demo import ModelSpec, build_model, train_step
from deck.processes import end_rank, free_port, init_process_group

# Goals: with the default configuration the stall should approach the gather of the
# same rows (<= 1.5x), and be at most 1/100 of a blocking dcp.save of the same model.
GATHER_GOAL = 1.5
DCP_GOAL = 1 / 100
AFTER_STEPS = 10  # steps after a checkpoint counted as "while the background stager works"
# StagingConfig fields the command line may set (--chunks-in-flight, ...); unset: the default
STAGING_FLAGS = ("chunks_in_flight", "background_nice", "chunk_bytes", "bundle_bytes")


def _quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)


def _gather(ckpt: Any) -> tuple[float, int]:
    """Time the pure gather of the rows the next delta will save: every state of every touched
    row ``index_select``-ed into one preallocated buffer (the floor of any snapshot that copies
    rows out of the live tables). Reads the tracker without consuming it (the rows stay pending
    for the delta). Returns (seconds, bytes gathered)."""
    import torch

    tracker = ckpt.tracker
    token = tracker.begin_read(ckpt._ckpt.consumer)
    try:
        jobs = []
        total = 0
        for sh in ckpt.adapter.table_shards():
            sel = (
                None
                if sh.full_only
                else tracker.touched(token, sh.track_base, sh.track_base + sh.rows)
            )
            for v in sh.states.values():
                n = sh.rows if sel is None else int(sel.numel())
                shape = (n, *v.shape[1:])
                nbytes = n * v[0:1].numel() * v.element_size()
                jobs.append((v, sel, shape, total, nbytes))
                total += -(-nbytes // 8) * 8  # keep every view aligned
        buf = torch.zeros(total, dtype=torch.uint8)  # faulted in: deck's pool buffers are warm
        outs = [buf[off : off + nb].view(v.dtype).view(shape) for v, _, shape, off, nb in jobs]
        t0 = time.perf_counter()
        for (v, sel, _, _, _), out in zip(jobs, outs, strict=True):
            if sel is None:
                out.copy_(v)
            else:
                torch.index_select(v, 0, sel, out=out)
        dt = time.perf_counter() - t0
    finally:
        tracker.abort(token)
    return dt, total


def _thread_clock() -> dict[str, tuple[float, float]]:
    """CPU time and run-queue wait (s) of this process's threads so far, from Linux's
    ``/proc/self/task/*/schedstat``: per Python thread name (numbered pool threads summed:
    ``deck-spool``, ``deck-commit``, ...) plus ``train`` (the main thread) and ``native``
    (threads Python did not start: gloo, OpenMP). Empty where there is no schedstat."""
    import threading

    names = {t.native_id: t.name.rsplit("_", 1)[0] for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "train"
    out: dict[str, tuple[float, float]] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
                name = names.get(int(tid), "native")
                run, wait = out.get(name, (0.0, 0.0))
                out[name] = (run + run_ns / 1e9, wait + wait_ns / 1e9)
    return out


def _intervals(clocks: list[dict[str, tuple[float, float]]]) -> dict[str, list[list[float]]]:
    """Per thread group, its [CPU, run-queue wait] in each interval between consecutive clocks."""
    out: dict[str, list[list[float]]] = {}
    names = set().union(*clocks)  # a thread started mid-run counts 0 before it
    for before, after in itertools.pairwise(clocks):
        for name in names:
            a, b = after.get(name, (0.0, 0.0)), before.get(name, (0.0, 0.0))
            out.setdefault(name, []).append([a[0] - b[0], a[1] - b[1]])
    return out


def _run_target(
    model: Any, dense_opt: Any, spec: ModelSpec, a: argparse.Namespace, target: dict[str, Any]
) -> dict[str, Any]:
    """Train ``a.steps`` steps after ``target['first_step']`` with a DeltaCheckpointer."""
    import deck
    from deck.config import StagingConfig

    extra = {k: v for k in STAGING_FLAGS if (v := getattr(a, k)) is not None}
    staging = StagingConfig(
        tiers=target["tiers"],
        spool_dir=target.get("spool"),
        release=target["release"],
        copy_on_write=target.get("cow", "deltas"),
        **extra,
        **({"mode": a.staging_mode} if a.staging_mode else {}),
    )
    config = deck.DeckConfig(
        uri=target["uri"],
        delta_every_steps=a.delta_every,
        storage_options=target.get("storage_options", {}),
        staging=staging,
    )
    first = target["first_step"]
    step_s: list[tuple[int, float]] = []
    step_cpu: list[tuple[int, float]] = []  # the training thread's CPU in the step
    ckpt_call_s: list[tuple[int, float]] = []
    gather_s: list[tuple[int, float, int]] = []
    with deck.enable(model, [dense_opt], config) as ckpt:
        ckpt.step(first)  # the first checkpoint of a process is a full
        if a.settle:
            ckpt.flush()  # deltas then measure the steady state, not the full's upload
        clocks = [_thread_clock()]
        for step in range(first + 1, first + a.steps + 1):
            t0, c0 = time.perf_counter(), time.thread_time()
            train_step(model, dense_opt, spec, step)
            c1 = time.thread_time()
            if step % a.delta_every == 0 and a.gather:
                gather_s.append((step, *_gather(ckpt)))
            t1 = time.perf_counter()
            ckpt.step(step)
            t2 = time.perf_counter()
            step_s.append((step, t1 - t0))
            step_cpu.append((step, c1 - c0))
            if step % a.delta_every == 0:
                ckpt_call_s.append((step, t2 - t1))
                clocks.append(_thread_clock())  # outside the timed step
        t0 = time.perf_counter()
        ckpt.flush()
        flush_s = time.perf_counter() - t0
        history = [
            {
                "step": h.step,
                "kind": h.kind,
                "stall_s": h.stall_s,
                "job_stall_s": h.job_stall_s,
                "pool_bytes": h.pool_bytes,
                "pool_capped": h.pool_capped,
                "bytes": h.bytes,
                "rows": h.rows,
                "chunks": h.chunks,
                "buffer_wait_s": h.buffer_wait_s,
                "agree_s": h.agree_s,
                "claim_s": h.claim_s,
                "snapshot_s": h.snapshot_s,
                "copied_after": h.copied_after,
                "durable_local_s": h.durable_local_s,
                "committed_s": h.committed_s,
                "state": h.state,
                "error": h.error,
            }
            for h in ckpt.history
        ]
        tier = ckpt.stager.tier
    return {
        "name": target["name"],
        "tier": tier,
        "history": history,
        "step_s": step_s,
        "step_cpu": step_cpu,
        "ckpt_call_s": ckpt_call_s,
        "gather_s": gather_s,
        "final_flush_s": flush_s,
        "cpu": _intervals(clocks),
    }


class _PlainWriter:
    """The baseline of the steps after a delta: a thread that writes ``nbytes`` as 4 MiB files
    (O_DIRECT from one page-aligned buffer, fsync each), niced like deck's background threads.
    Nothing of deck runs: what it costs training is the cost of the bytes reaching the disk."""

    CHUNK = 4 << 20

    def __init__(self, folder: str, nice: int) -> None:
        import mmap
        import queue
        import threading

        self.folder = folder
        self.nice = nice
        self.buf = mmap.mmap(-1, self.CHUNK)
        self.buf.write(os.urandom(self.CHUNK))
        self.jobs: queue.Queue[int | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="plain-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import threading

        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, self.nice)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
        n = 0
        job = 0
        while (nbytes := self.jobs.get()) is not None:
            job += 1
            sub = os.path.join(self.folder, f"j{job}")  # new files each time, as deck's
            os.makedirs(sub)
            for _ in range(-(-nbytes // self.CHUNK)):
                fd = os.open(os.path.join(sub, f"f{n}"), flags, 0o644)
                try:
                    os.write(fd, self.buf)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                n += 1
            self.jobs.task_done()
        self.jobs.task_done()

    def close(self) -> None:
        self.jobs.put(None)
        self.jobs.join()


def _run_plain_writes(
    model: Any, dense_opt: Any, spec: ModelSpec, a: argparse.Namespace, nbytes: int, folder: str
) -> dict[str, Any]:
    """The same training as a target, without deck: every ``a.delta_every`` steps a plain
    writer thread is handed ``nbytes`` (what this rank's deltas wrote)."""
    os.makedirs(folder, exist_ok=True)
    writer = _PlainWriter(folder, nice=19)
    step_s: list[tuple[int, float]] = []
    step_cpu: list[tuple[int, float]] = []
    first = 2 * 10**6  # steps outside every target's range
    clocks = [_thread_clock()]
    try:
        for step in range(first + 1, first + a.steps + 1):
            t0, c0 = time.perf_counter(), time.thread_time()
            train_step(model, dense_opt, spec, step)
            step_s.append((step - first, time.perf_counter() - t0))
            step_cpu.append((step - first, time.thread_time() - c0))
            if step % a.delta_every == 0:
                writer.jobs.put(nbytes)
                clocks.append(_thread_clock())
    finally:
        writer.close()
        shutil.rmtree(folder, ignore_errors=True)
    return {"step_s": step_s, "step_cpu": step_cpu, "nbytes": nbytes, "cpu": _intervals(clocks)}


def _dcp_save(state: dict[str, Any], path: str) -> float:
    import torch.distributed.checkpoint as dcp

    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    return time.perf_counter() - t0


def _worker(
    rank: int, world_size: int, port: int, a: argparse.Namespace, targets: list[dict], out: str
) -> None:
    _quiet()
    init_process_group(rank, world_size, port)
    spec = ModelSpec(num_tables=a.tables, rows=a.rows, dim=a.dim, batch=a.batch)
    model, dense_opt = build_model(spec)
    for _ in range(a.warmup):
        train_step(model, dense_opt, spec, 10**6)  # steps outside every target's range
    results: dict[str, Any] = {"targets": [], "dcp_s": []}
    for target in targets:
        results["targets"].append(_run_target(model, dense_opt, spec, a, target))
        dist.barrier()
    deltas = [h["bytes"] for h in results["targets"][0]["history"] if h["kind"] == "delta"]
    if a.plain_writes and deltas:
        per_rank = int(statistics.median(deltas)) // world_size
        folder = os.path.join(a.out, f"plain-writes-{rank}")
        results["plain"] = _run_plain_writes(model, dense_opt, spec, a, per_rank, folder)
        dist.barrier()
    for i in range(a.dcp_repeats):
        path = os.path.join(a.out, f"dcp-{i}")
        state = {"model": model.state_dict(), "optim": dense_opt.state_dict()}
        results["dcp_s"].append(_dcp_save(state, path))
        if i == 0 and rank == 0:
            results["dcp_bytes"] = sum(
                os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
            )
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    with open(os.path.join(a.results, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # dcp.async_save, once, last: if it hangs, the parent kills us with the results already saved.
    import torch.distributed.checkpoint as dcp

    path = os.path.join(a.out, "dcp-async")
    t0 = time.perf_counter()
    try:
        fut = dcp.async_save(
            {"model": model.state_dict(), "optim": dense_opt.state_dict()}, checkpoint_id=path
        )
        fut.result(timeout=a.async_timeout)
        outcome = {"ok": True, "seconds": time.perf_counter() - t0}
    except BaseException as e:
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        outcome = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}".strip(),
            "where": tb[-2].strip() if len(tb) > 1 else "",
        }
    with open(os.path.join(a.results, f"async{rank}.json"), "w") as f:
        json.dump(outcome, f)
    with contextlib.suppress(Exception):
        dist.barrier()
    end_rank()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _cpu_line(cpus: list[dict[str, list[list[float]]]], a: argparse.Namespace) -> str:
    """Where each rank's CPU went per interval of --delta-every steps (medians over intervals):
    the training thread's CPU and its run-queue wait (time it was ready to run but another
    thread had the core), and every other Python thread's CPU by name (deck's background, or
    the plain writer)."""
    parts = []
    for r, cpu in enumerate(cpus):
        if not cpu:
            continue
        train = cpu.get("train", [[0.0, 0.0]])
        bg = {
            k: _median([x[0] for x in v])
            for k, v in sorted(cpu.items())
            if k not in ("train", "native")
        }
        total = _median(
            [sum(v[i][0] for k, v in cpu.items() if k in bg) for i in range(len(train))]
        )
        parts.append(
            f"rank {r}: training thread {_median([x[0] for x in train]) * 1e3:.0f} ms CPU, "
            f"{_median([x[1] for x in train]) * 1e3:.1f} ms waiting for a core; background "
            f"{total * 1e3:.1f} ms CPU ("
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in bg.items() if v >= 5e-5)
            + ")"
        )
    return f"CPU per {a.delta_every}-step interval (medians): " + "; ".join(parts)


def _own_cpu_line(phase: dict[str, Any], after: set[int], skip: set[int]) -> str:
    """Rank 0's training thread's own CPU per step (median) in the steps ``after`` a delta vs
    the others, leaving out ``skip`` (the steps after a full)."""
    cpu = dict(phase.get("step_cpu", []))
    c_after = _median([c for st, c in cpu.items() if st in after])
    c_away = _median([c for st, c in cpu.items() if st not in after | skip])
    return (
        f"the training thread's own CPU per step (rank 0): away {c_away * 1e3:.1f} ms, the "
        f"{AFTER_STEPS} after a delta {c_after * 1e3:.1f} ms ({c_after / c_away - 1:+.1%})"
    )


def _staging_mode(a: argparse.Namespace) -> str:
    """The StagingConfig.mode deck's checkpointers run with."""
    from deck.config import StagingConfig

    return a.staging_mode or StagingConfig().mode


def _report(
    a: argparse.Namespace, ranks: list[dict], asyncs: list[dict | None]
) -> list[tuple[str, dict[str, float] | None]]:
    """Print one run's results; returns each target's summary (medians of its deltas)."""
    r0 = ranks[0]
    dcp_med = _median([max(r["dcp_s"][i] for r in ranks) for i in range(len(r0["dcp_s"]))])
    model_bytes = a.tables * a.rows * (a.dim * 4 + 4)
    print(
        f"DLRM {a.tables} tables x {a.rows} rows x {a.dim} dim fp32 ({_mib(model_bytes)} of table "
        f"weights + momentum1), EXACT_ROWWISE_ADAGRAD, Zipf ids, batch {a.batch}/rank, 2 gloo ranks, "
        f"{a.steps} steps per target, a delta every {a.delta_every} steps, staging mode "
        f"{_staging_mode(a)}; "
        + (
            "first full committed before training on (--settle)"
            if a.settle
            else "training goes on while the first full uploads"
        )
    )
    print()
    print(
        f"torch.distributed.checkpoint.save (model + dense optimizer), {len(r0['dcp_s'])} repeats: "
        + ", ".join(f"{max(r['dcp_s'][i] for r in ranks):.2f}" for i in range(len(r0["dcp_s"])))
        + f" s; median {dcp_med:.3f} s; {_mib(r0.get('dcp_bytes', 0))} on disk"
    )
    print()
    for ti, t in enumerate(r0["targets"]):
        hists = [r["targets"][ti]["history"] for r in ranks]
        print(f"== target {t['name']} (tier {t['tier']}) ==")
        print(
            f"{'step':>6} {'kind':>6} {'rows':>10} {'bytes':>11} {'stall s':>8} "
            f"{'durable s (r0/r1)':>18} {'committed s (r0/r1)':>20} {'state':>10} "
            f"{'job ms':>7} {'gather ms':>9} {'/gather':>7} {'wait ms':>7} {'cow rows':>9}"
        )
        gathered = {g[0]: g[1] for g in t.get("gather_s", [])}
        for i, h in enumerate(hists[0]):
            dur = "/".join(_fmt_s(hs[i]["durable_local_s"]) for hs in hists)
            com = "/".join(_fmt_s(hs[i]["committed_s"]) for hs in hists)
            g = gathered.get(h["step"])
            print(
                f"{h['step']:>6} {h['kind']:>6} {h['rows']:>10} {_mib(h['bytes']):>11} "
                f"{h['stall_s']:>8.3f} {dur:>18} {com:>20} {h['state']:>10} "
                f"{h['job_stall_s'] * 1e3:>7.1f} "
                + (f"{g * 1e3:>9.1f} {h['job_stall_s'] / g:>6.2f}x " if g else f"{'':>17} ")
                + f"{h['buffer_wait_s'] * 1e3:>7.1f} {h.get('copied_after', 0):>9}"
            )
        deltas = [h for h in hists[0] if h["kind"] == "delta"]
        fulls = [h for h in hists[0] if h["kind"] == "full"]
        steps = dict(t["step_s"])
        near: dict[str, set[int]] = {"full": set(), "delta": set()}
        for h in hists[0]:
            near[h["kind"]].update(range(h["step"] + 1, h["step"] + 1 + AFTER_STEPS))
        after = [s for st, s in steps.items() if st in near["delta"] and st not in near["full"]]
        after_full = [s for st, s in steps.items() if st in near["full"]]
        away = [s for st, s in steps.items() if st not in near["full"] | near["delta"]]
        if deltas:
            stall = _median([h["job_stall_s"] for h in deltas])
            rank_stall = _median([h["stall_s"] for h in deltas])
            dbytes = _median([h["bytes"] for h in deltas])
            rows = _median([h["rows"] for h in deltas])
            dur = _median(
                [
                    max(hs[i]["durable_local_s"] or 0 for hs in hists)
                    for i, h in enumerate(hists[0])
                    if h["kind"] == "delta"
                ]
            )
            com = _median(
                [
                    hs[i]["committed_s"] or float("nan")
                    for hs in hists[:1]
                    for i, h in enumerate(hists[0])
                    if h["kind"] == "delta"
                ]
            )
            full_b = fulls[0]["bytes"] if fulls else float("nan")
            ratio = stall / dcp_med
            t["summary"] = {"stall": stall, "ratio": ratio}
            gathers = {g[0]: g[1] for g in t.get("gather_s", [])}
            g_bytes = _median([g[2] for g in t.get("gather_s", [])])
            pairs = [(h["job_stall_s"], gathers[h["step"]]) for h in deltas if h["step"] in gathers]
            if pairs:
                gather = _median([g for _, g in pairs])
                per = _median([st / g for st, g in pairs])
                t["summary"].update(gather=gather, stall_gather=per)
                print(
                    f"pure gather of the same rows (index_select into one buffer, rank 0, "
                    f"{_mib(g_bytes)}): median {gather * 1e3:.1f} ms; stall / gather median "
                    f"{per:.1f}x (goal <= {GATHER_GOAL}: {'MET' if per <= GATHER_GOAL else 'NOT MET'})"
                )
            waits = _median([h.get("buffer_wait_s", 0.0) for h in deltas])
            pool = max(h["pool_bytes"] for h in deltas)
            capped = sum(h["pool_capped"] for h in deltas)
            print(
                f"chunk buffer pool (sized from the parts): {_mib(pool)}, capped in {capped} of "
                f"{len(deltas)} deltas; waiting for buffers median {waits * 1e3:.1f} ms"
            )
            parts = {
                k: _median([h[k] for h in deltas]) for k in ("agree_s", "claim_s", "snapshot_s")
            }
            rest = _median([h["stall_s"] - sum(h[k] for k in parts) for h in deltas])
            print(
                "where a rank's time in the call went (medians, slowest rank each): dense state "
                f"(+ an agreement only when nothing was settled) {parts['agree_s'] * 1e3:.1f} ms, "
                f"claim {parts['claim_s'] * 1e3:.1f} ms, snapshot {parts['snapshot_s'] * 1e3:.1f} ms, "
                f"vote (the one all-gather; absorbs the ranks' arrival skew) ~{rest * 1e3:.1f} ms"
            )
            print(
                f"stall = the job's (last rank's arrival -> release, wall clocks) {stall * 1e3:.1f} ms;"
                f" the slowest rank's time in the call (incl. waiting for late ranks) "
                f"{rank_stall * 1e3:.1f} ms"
            )
            print(
                f"median of {len(deltas)} deltas: stall {stall:.3f} s, {rows:.0f} rows, "
                f"{_mib(dbytes)} ({dbytes / full_b:.3f} of the full's {_mib(full_b)}), "
                f"durable-local {dur:.3f} s (max of ranks), committed {com:.3f} s (rank 0)"
            )
            print(
                f"stall / DCP save = {stall:.3f} / {dcp_med:.3f} = {ratio:.4f} (1/{1 / ratio:.0f}); "
                f"goal <= 1/{1 / DCP_GOAL:.0f}: {'MET' if ratio <= DCP_GOAL else 'NOT MET'}"
            )
        if fulls:
            print(
                f"full checkpoint stall {fulls[0]['stall_s']:.3f} s "
                f"({fulls[0]['stall_s'] / dcp_med:.3f} of DCP save)"
            )
        slow = _median(after) / _median(away) - 1
        t.setdefault("summary", {})["after_delta"] = slow
        print(
            f"train step median {_median(away) * 1e3:.1f} ms away from checkpoints; in the "
            f"{AFTER_STEPS} steps after a delta (its spool/fsync/commit running) "
            f"{_median(after) * 1e3:.1f} ms ({slow:+.1%}; goal <= +2%), after the full "
            f"{_median(after_full) * 1e3:.1f} ms; final flush {t['final_flush_s']:.2f} s"
        )
        print(_cpu_line([r["targets"][ti].get("cpu", {}) for r in ranks], a))
        print(_own_cpu_line(t, near["delta"] - near["full"], near["full"]))
        print()
    plain = r0.get("plain")
    if plain:
        near = {
            s
            for k in range(a.delta_every, a.steps + 1, a.delta_every)
            for s in range(k + 1, k + 1 + AFTER_STEPS)
        }
        after = [s for st, s in plain["step_s"] if st in near]
        away = [s for st, s in plain["step_s"] if st not in near]
        slow = _median(after) / _median(away) - 1
        for t in r0["targets"]:
            if t.get("summary"):
                t["summary"]["after_plain"] = slow
        print(
            f"baseline, no deck: the same training, a plain O_DIRECT writer thread (nice 19) "
            f"handed {_mib(plain['nbytes'])} per rank (a delta's bytes) every {a.delta_every} "
            f"steps as 4 MiB files: steps away {_median(away) * 1e3:.1f} ms, the {AFTER_STEPS} "
            f"after {_median(after) * 1e3:.1f} ms ({slow:+.1%}): what the bytes reaching the "
            "disk cost training here, whoever writes them"
        )
        print(_cpu_line([r.get("plain", {}).get("cpu", {}) for r in ranks], a))
        print(_own_cpu_line(plain, near, set()))
        print()
    a_ok = [x for x in asyncs if x is not None]
    if not a_ok:
        print(
            f"dcp.async_save: no result within {a.async_timeout + 60:.0f} s (hung; processes killed)"
        )
    elif all(x["ok"] for x in a_ok):
        print(f"dcp.async_save: WORKS here ({max(x['seconds'] for x in a_ok):.2f} s)")
    else:
        bad = next(x for x in a_ok if not x["ok"])
        print(f"dcp.async_save: FAILS on this stack: {bad['error'][:400]}")
        if bad.get("where"):
            print(f"  raised at {bad['where'].splitlines()[0]}")
    summary = [(t["name"], t.get("summary")) for t in r0["targets"]]
    for _, s in summary:
        if s:
            s["dcp"] = dcp_med
    print()
    print(
        f"{'target':<26} {'median delta stall s':>21} {'DCP save s':>11} {'stall/DCP':>10} {'goal':>6}"
        f" {'gather s':>9} {'stall/gather':>13}"
    )
    for name, s in summary:
        if s:
            print(
                f"{name:<26} {s['stall']:>21.3f} {dcp_med:>11.3f} {s['ratio']:>10.4f} "
                f"{'MET' if s['ratio'] <= DCP_GOAL else 'NO':>6}"
                + (f" {s['gather']:>9.4f} {s['stall_gather']:>13.1f}" if "gather" in s else "")
            )
    print()
    print("reproduce: " + " ".join([os.path.relpath(sys.executable), *sys.argv]))
    return summary


def _report_runs(runs: list[list[tuple[str, dict[str, float] | None]]]) -> None:
    """The median over repeated runs of each target's per-run medians (how the goals are judged)."""
    print(f"== median over {len(runs)} runs (each run: the median of its deltas)")
    print(
        f"{'target':<26} {'stall s':>9} {'stall/DCP':>10} {'stall/gather':>13}   per run (stall/gather)"
    )
    for i, (name, _) in enumerate(runs[0]):
        got = [run[i][1] for run in runs if run[i][1]]
        if not got:
            continue
        ratio = _median([g["ratio"] for g in got])
        line = f"{name:<26} {_median([g['stall'] for g in got]):>9.4f} {ratio:>10.4f}"
        per = [g["stall_gather"] for g in got if "stall_gather" in g]
        if per:
            goal = "MET" if _median(per) <= GATHER_GOAL else "NOT MET"
            line += f" {_median(per):>12.2f}x   " + ", ".join(f"{x:.2f}x" for x in per)
            line += f"  (goal <= {GATHER_GOAL}x: {goal}; stall/DCP goal <= 1/100: "
            line += f"{'MET' if ratio <= DCP_GOAL else 'NOT MET'})"
        print(line)
        slow = [g["after_delta"] for g in got if "after_delta" in g]
        if slow:
            print(
                f"{'':<26} the {AFTER_STEPS} steps after a delta vs away from checkpoints: median "
                f"{_median(slow):+.1%} (goal <= +2%), per run "
                + ", ".join(f"{x:+.1%}" for x in slow)
            )
        plain = [g["after_plain"] for g in got if "after_plain" in g]
        if plain:
            print(
                f"{'':<26} the same bytes by a plain writer thread, no deck: median "
                f"{_median(plain):+.1%}, per run " + ", ".join(f"{x:+.1%}" for x in plain)
            )
    print("reproduce: " + " ".join([os.path.relpath(sys.executable), *sys.argv]))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="100k rows, 100 steps, a delta every 25")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=None, help="rows per table (default 1000000)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=None, help="training steps per target (300)")
    p.add_argument("--delta-every", type=int, default=None, help="(default 50)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dcp-repeats", type=int, default=3)
    p.add_argument("--s3", action="store_true", help="also a SeaweedFS S3 target (cpu-ssd-remote)")
    p.add_argument(
        "--settle",
        action="store_true",
        help="wait for the first full to commit before training on (steady-state deltas; "
        "default: train on while it uploads, as a real job does)",
    )
    p.add_argument(
        "--server-nice",
        type=int,
        default=0,
        help="run the SeaweedFS server at this nice level (19: it yields the 2 cores to "
        "training, standing in for object storage on other machines; default 0)",
    )
    p.add_argument(
        "--no-gather",
        dest="gather",
        action="store_false",
        help="skip timing the pure gather of each delta's rows",
    )
    p.add_argument(
        "--no-plain-writes",
        dest="plain_writes",
        action="store_false",
        help="skip the baseline phase: the same training without deck, a plain O_DIRECT writer "
        "thread handed each delta's bytes every --delta-every steps",
    )
    p.add_argument("--no-local", action="store_true", help="skip the local-directory target")
    p.add_argument(
        "--release",
        default="in_memory,first_tier",
        help="StagingConfig.release values to run, one local target each, in this order (the "
        "S3 target uses the first); default: in_memory,first_tier",
    )
    for field in STAGING_FLAGS:
        p.add_argument(
            "--" + field.replace("_", "-"),
            type=int,
            default=None,
            help=f"StagingConfig.{field} (default: the config's default)",
        )
    p.add_argument(
        "--copy-on-write",
        default="deltas,all,off",
        help="StagingConfig.copy_on_write values to run with release=in_memory, one local "
        "target each, in this order (first_tier copies in the stall either way); default: "
        "deltas,all,off",
    )
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument(
        "--staging-mode",
        choices=["threads", "process"],
        default=None,
        help="StagingConfig.mode of deck's checkpointers (default: the config's default, "
        "$DECK_STAGING_MODE or threads)",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat the whole job this many times (fresh processes and folders each) and "
        "print the median over runs of each run's medians",
    )
    p.add_argument("--async-timeout", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many s")
    a = p.parse_args()
    if a.runs < 1:
        p.error("--runs must be at least 1")
    a.rows = a.rows or (100_000 if a.quick else 1_000_000)
    a.steps = a.steps or (100 if a.quick else 300)
    a.delta_every = a.delta_every or (25 if a.quick else 50)
    if a.steps % a.delta_every:
        p.error("--steps must be a multiple of --delta-every")
    work = a.workdir or tempfile.mkdtemp(prefix="deck-bench-stall-", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    server = None
    try:
        if a.s3:
            from deck.testing.s3_server import SeaweedS3

            server = SeaweedS3(
                workdir=os.path.join(work, "seaweed"),
                volume_size_limit_mb=256,
                nice=a.server_nice,
            )
            server.start()
            print(
                f"SeaweedFS S3 at {server.endpoint_url} (started in {server.startup_seconds:.1f} s)"
            )
        runs = []
        for run in range(a.runs):
            if a.runs > 1:
                print(f"== run {run + 1} of {a.runs}")
            runs.append(_run_once(a, os.path.join(work, f"run{run}"), server, run))
        if a.runs > 1:
            _report_runs(runs)
    finally:
        if server is not None:
            server.stop()
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _run_once(
    a: argparse.Namespace, work: str, server: Any, run: int
) -> list[tuple[str, dict[str, float] | None]]:
    """One whole job (both ranks, every target) in fresh folders under ``work``; prints its
    report and returns each target's summary."""
    a.out = os.path.join(work, "out")
    a.results = os.path.join(work, "results")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.results, exist_ok=True)
    targets: list[dict[str, Any]] = []
    first = 0
    releases = a.release.split(",")
    cows = a.copy_on_write.split(",")
    for release in [] if a.no_local else releases:
        for cow in cows if release == "in_memory" else cows[:1]:
            label = f", copy-on-write {cow}" if release == "in_memory" else ""
            targets.append(
                {
                    "name": f"local, release={release}{label}",
                    "uri": os.path.join(work, f"ck-local-{release}-{cow}"),
                    "tiers": "local",
                    "release": release,
                    "cow": cow,
                    "first_step": first,
                }
            )
            first += a.steps
    if server is not None:
        targets.append(
            {
                "name": f"s3, release={releases[0]}",
                "uri": server.uri(f"bench-stall-{run}"),
                "storage_options": server.storage_options,
                "tiers": "cpu-ssd-remote",
                "release": releases[0],
                "spool": os.path.join(work, "spool"),
                "first_step": first,
            }
        )
    t0 = time.perf_counter()
    ctx = mp.spawn(_worker, args=(2, free_port(), a, targets, a.out), nprocs=2, join=False)
    deadline = time.monotonic() + a.timeout
    async_deadline = None
    while not ctx.join(timeout=2):
        now = time.monotonic()
        done = all(os.path.exists(os.path.join(a.results, f"rank{r}.json")) for r in (0, 1))
        if done and async_deadline is None:
            async_deadline = now + a.async_timeout + 60
        if now > deadline or (async_deadline is not None and now > async_deadline):
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()  # our own spawned ranks, by pid
            break
    ranks = []
    for r in (0, 1):
        with open(os.path.join(a.results, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    asyncs: list[dict | None] = []
    for r in (0, 1):
        path = os.path.join(a.results, f"async{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                asyncs.append(json.load(f))
        else:
            asyncs.append(None)
    print(f"(run took {time.perf_counter() - t0:.0f} s)")
    return _report(a, ranks, asyncs)


if __name__ == "__main__":
    sys.exit(main())
