"""Checkpoints against a slow store: does a burst of checkpoints commit as it comes, or queue up?

The store is SeaweedFS S3 (started by this script) behind :class:`deck.testing.slow_store.
LatencyProxy`, which delays every byte ``--delay-ms`` each way (default 50: a 100 ms round
trip), so every request the S3 client makes pays the latency of a store far away.

A 2-rank gloo DLRM (``deck.demo``, ``--tables`` x ``--rows`` x ``--dim``, batch ``--batch``)
checkpoints to ``s3://`` through the default staging (spool, uploads, rank 0's commit thread)
with the writer lease on (the default: its fence reads the store before every commit record):

1. **one commit alone** (``--alone`` times, the median): a delta, then ``flush()``; its time is
   rank 0's ``committed_s`` (snapshot start -> commit record written), and the requests each
   rank made for it (counted at the S3 client, by operation);
2. **a burst**: ``--checkpoints`` deltas ``--interval`` s apart (a training step, then a wait
   for the next slot, then ``step()``), then ``flush()``. Reported: the time from the first
   ``step()`` to the last commit, the last checkpoint's own commit latency, and how long the
   final ``flush()`` waited, each against one commit alone; and the requests per checkpoint;
3. **maintenance through the delay**: ``deck verify --all``'s reads (read_manifests +
   verify_checkpoint of every checkpoint), a merge pass (``MergeWorker.run_once``) and a GC
   (``collect_garbage``, default policy) on a copy of the burst's URI, each through the proxy
   and straight to the server (the baseline), alternating, ``--ops-repeats`` times (medians).

``--code DIR`` runs the trainer ranks and the maintenance with the ``deck`` package of another
checkout (e.g. ``git worktree add /tmp/deck-old <commit>``): the "before" of a change, in the
same run's conditions (the proxy and the server are this checkout's).

    python benchmarks/bench_slow_store.py [--delay-ms 50] [--checkpoints 20] [--interval 0.16]
    python benchmarks/bench_slow_store.py --code /tmp/deck-old     # the old code, same setup
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import torch.multiprocessing as mp


def _use_code(code: str | None) -> None:
    if code:
        sys.path.insert(0, code)  # its deck/ wins over the editable install (a meta path hook)


def _slow_store() -> Any:
    """This checkout's deck/testing/slow_store.py (stdlib only), whichever deck runs."""
    path = os.path.join(os.path.dirname(__file__), "..", "deck", "testing", "slow_store.py")
    spec = importlib.util.spec_from_file_location("bench_slow_store_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fs(storage: Any) -> Any:
    """The fsspec filesystem of an ``FsspecStorage`` (of whichever deck runs)."""
    return storage.fs


def _worker(rank: int, world_size: int, port: int, a: dict[str, Any], out: str) -> None:
    _use_code(a["code"])
    import logging

    import torch.distributed as dist

    import deck
    from deck.demo import ModelSpec, TrainState, build_model, train_step
    from deck.processes import end_rank, init_process_group
    from deck.storage import open_storage

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    init_process_group(rank, world_size, port)
    spec = ModelSpec(num_tables=a["tables"], rows=a["rows"], dim=a["dim"], batch=a["batch"])
    model, opt = build_model(spec)
    user = TrainState()
    config = deck.DeckConfig(
        uri=a["uri"],
        delta_every_steps=1,
        storage_options=a["options"],
        staging=deck.StagingConfig(spool_dir=a["spool"]),
    )
    # The same fsspec instance as the checkpointer's (same options): its requests are counted.
    counts = _slow_store().S3Requests(_fs(open_storage(a["uri"], a["options"])))
    res: dict[str, Any] = {"deck": deck.__file__}
    step = 0
    with deck.enable(model, [opt], config, state=user) as ck:
        ck.step(step)
        ck.flush()
        alone, alone_req = [], []
        for _ in range(a["alone"]):
            step += 1
            train_step(model, opt, spec, step)
            dist.barrier()
            counts.clear()
            stats = ck.step(step)
            assert stats is not None
            ck.flush()
            alone.append(stats.committed_s)
            alone_req.append(dict(counts))
            trace = [
                (t0 - stats.started, t1 - stats.started, m, k) for t0, t1, m, k in counts.timeline
            ]
        dist.barrier()
        counts.clear()
        burst = []
        t0 = time.perf_counter()
        for i in range(a["checkpoints"]):
            step += 1
            train_step(model, opt, spec, step)
            wait = t0 + i * a["interval"] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            called = time.perf_counter() - t0
            stats = ck.step(step)
            assert stats is not None
            burst.append((called, stats))
        last_call = time.perf_counter() - t0
        ck.flush()
        flushed = time.perf_counter() - t0
        burst_req = dict(counts)
        states = [s.state for _, s in burst]
    res.update(
        trace=sorted(trace),
        alone=alone,
        alone_requests=alone_req,
        burst_requests=burst_req,
        states=states,
        called=[c for c, _ in burst],
        committed=[s.started - t0 + (s.committed_s or float("nan")) for _, s in burst],
        last_call=last_call,
        flushed=flushed,
    )
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    end_rank()


def _train(a: dict[str, Any], out: str) -> list[dict[str, Any]]:
    from deck.processes import free_port

    mp.spawn(_worker, args=(2, free_port(), a, out), nprocs=2, join=True)
    return [json.loads(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(2)]


def _ops(
    code: str | None, uri: str, copy: str, options: dict[str, Any]
) -> dict[str, tuple[float, dict[str, int]]]:
    """Seconds and S3 requests of verify (of ``uri``), then of a merge pass and a GC of
    ``copy``, through ``options``' endpoint; run in a child for ``--code``."""
    _use_code(code)
    from deck.merge.worker import MergeWorker
    from deck.ops.retention import collect_garbage
    from deck.read.catalog import read_manifests
    from deck.read.verify import verify_checkpoint
    from deck.storage import open_storage

    out: dict[str, tuple[float, dict[str, int]]] = {}
    storage = open_storage(uri, options)
    requests = _slow_store().S3Requests(_fs(storage))
    t0 = time.perf_counter()
    manifests = read_manifests(storage)
    bad = [m.step for m in manifests.all() if not verify_checkpoint(storage, m).ok]
    out["verify"] = (time.perf_counter() - t0, requests.taken())
    if bad or len(manifests) < 2:
        raise RuntimeError(f"verify of {uri}: {len(manifests)} checkpoints, problems in {bad}")
    target = open_storage(copy, options)
    if _fs(target) is not _fs(storage):  # fsspec keeps one client per options, usually
        requests = _slow_store().S3Requests(_fs(target))
    requests.taken()
    t0 = time.perf_counter()
    stats, _ = MergeWorker(target).run_once(wait_s=0)
    out["merge"] = (time.perf_counter() - t0, requests.taken())
    if not stats.items_committed:
        raise RuntimeError(f"the merge pass of {copy} committed nothing")
    t0 = time.perf_counter()
    collect_garbage(target)
    out["gc"] = (time.perf_counter() - t0, requests.taken())
    return out


def _ops_child(code: str | None, uri: str, copy: str, options: dict[str, Any], q: Any) -> None:
    try:
        q.put(_ops(code, uri, copy, options))
    except BaseException as e:
        q.put(f"{type(e).__name__}: {e}")
        raise


def _copy_prefix(fs: Any, src: str, dst: str) -> None:
    for key in fs.find(src):
        fs.copy(key, dst + key[len(src) :])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--delay-ms", type=float, default=50.0, help="added each way (ms)")
    p.add_argument("--checkpoints", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.16, help="seconds between checkpoints")
    p.add_argument("--alone", type=int, default=3, help="single commits timed (median)")
    p.add_argument("--ops-repeats", type=int, default=3)
    p.add_argument("--tables", type=int, default=3)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--code", default=None, help="another checkout whose deck/ to run")
    p.add_argument("--trace", action="store_true", help="print one commit's requests in time")
    a = p.parse_args(argv)
    code = os.path.abspath(a.code) if a.code else None

    from deck.testing.s3_server import SeaweedS3

    LatencyProxy = _slow_store().LatencyProxy

    work = tempfile.mkdtemp(prefix="deck-slow-store-")
    server = SeaweedS3(workdir=os.path.join(work, "seaweed"), nice=5).start()
    proxy = LatencyProxy(server.ports["s3"], a.delay_ms / 1000).start()
    try:
        slow = proxy.s3_options(server.storage_options)
        run = f"run-{uuid.uuid4().hex[:8]}"
        args = {
            "code": code,
            "uri": server.uri(run),
            "options": slow,
            "spool": os.path.join(work, "spool"),
            **{k: getattr(a, k) for k in ("checkpoints", "interval", "alone")},
            **{k: getattr(a, k) for k in ("tables", "rows", "dim", "batch")},
        }
        os.makedirs(os.path.join(work, "out"))
        ranks = _train(args, os.path.join(work, "out"))
        r0 = ranks[0]
        print(f"deck package: {r0['deck']}")
        print(
            f"store: SeaweedFS S3 behind a {2 * a.delay_ms:.0f} ms round trip; model: 2 ranks, "
            f"{a.tables} x {a.rows} x {a.dim}, batch {a.batch}"
        )
        alone = statistics.median(r0["alone"])
        print(
            f"one commit alone: {alone:.3f} s (each: {', '.join(f'{x:.3f}' for x in r0['alone'])})"
        )
        for r, res in enumerate(ranks):
            print(f"  requests of rank {r} for it: {_fmt(res['alone_requests'][-1])}")
            if a.trace:
                for t0, t1, m, k in res["trace"]:
                    print(f"    {t0:6.3f} .. {t1:6.3f} s {m} {k.split('/', 1)[-1]}")
        n = a.checkpoints
        committed = r0["committed"]
        last_commit = max(committed)
        own = committed[-1] - r0["called"][-1]
        tail = r0["flushed"] - r0["last_call"]
        ideal = r0["called"][-1] + alone
        print(f"burst of {n} checkpoints {a.interval} s apart: states {set(r0['states'])}")
        print("  commits at " + ", ".join(f"{c:.2f}" for c in committed) + " s")
        print(
            f"  first step() -> last commit: {last_commit:.2f} s = {last_commit / alone:.1f}x one "
            f"commit alone (the last step() was at {r0['called'][-1]:.2f} s: {ideal:.2f} s at best"
            f", {last_commit / ideal:.2f}x that)"
        )
        print(f"  the last checkpoint's own commit latency: {own:.2f} s = {own / alone:.1f}x alone")
        print(f"  the final flush() waited {tail:.2f} s")
        for r, res in enumerate(ranks):
            per = {k: round(v / n, 1) for k, v in res["burst_requests"].items()}
            print(f"  requests per checkpoint, rank {r}: {_fmt(per)}")

        import fsspec

        fs = fsspec.filesystem("s3", **server.storage_options)
        src = f"{server.bucket}/{run}"
        times: dict[str, dict[str, list[float]]] = {"delay": {}, "direct": {}}
        counts: dict[str, dict[str, int]] = {}
        ctx = mp.get_context("spawn")
        for i in range(a.ops_repeats):
            for how in ("delay", "direct") if i % 2 == 0 else ("direct", "delay"):
                copy = f"{src}-copy-{how}-{i}"
                _copy_prefix(fs, src, copy)
                q = ctx.Queue()
                child = ctx.Process(
                    target=_ops_child,
                    args=(
                        code,
                        server.uri(run),
                        f"s3://{copy}",
                        slow if how == "delay" else server.storage_options,
                        q,
                    ),
                )
                child.start()
                got = q.get(timeout=1800)
                child.join()
                if isinstance(got, str):
                    raise RuntimeError(got)
                for k, (seconds, made) in got.items():
                    times[how].setdefault(k, []).append(seconds)
                    counts[k] = made
        for k in ("verify", "merge", "gc"):
            d, s = statistics.median(times["direct"][k]), statistics.median(times["delay"][k])
            print(
                f"{k}: {s:.2f} s through the delay, {d:.2f} s direct: {s / d:.1f}x "
                f"(medians of {a.ops_repeats}); requests {_fmt(counts[k])}"
            )
        print("reproduce: python benchmarks/bench_slow_store.py " + " ".join(argv or sys.argv[1:]))
    finally:
        proxy.stop()
        server.stop()
    return 0


def _fmt(counts: Mapping[str, float]) -> str:
    total = sum(counts.values())
    return f"{total:g} ({', '.join(f'{k} {v:g}' for k, v in sorted(counts.items()))})"


if __name__ == "__main__":
    sys.exit(main())
