"""Delta stall against a URI with a long history: 10,000 committed checkpoints, with and without
a quarantine record, on local disk and on S3 behind a 100 ms round trip.

The stall must not grow with what the URI holds, nor with the store's latency: whether the
parent's chain is broken is learned in the background after each commit, never in the stall
(docs/architecture.md, "Who calls what": the lineage thread).

**The history** (``--history`` checkpoints, steps 0 .. N-1: a full every 100 steps, deltas
between): one real checkpoint is written by :class:`deck.testing.synth.SynthTrainer` (the real
writer and format) into a scratch folder; its commit record is re-dumped for each step with a
fresh id, step, kind and parent link (``model_copy`` + ``dump_model``: valid records with their
own checksums), and only those ``step-*/manifest.json`` records are written -- the rank and chunk
files they name are not (nothing here reads them: the lineage is commit records only). Local:
plain file writes (a fixture: no fsync), about a second; S3: concurrent PUTs straight to the
server (not through the delay).

**The conditions**, in one pair of processes (2 gloo ranks, the demo DLRM of ``--tables`` x
``--rows`` x ``--dim``, batch ``--batch``), each with a fresh ``DeltaCheckpointer`` (default
configuration; its steps follow the history's):

- ``empty``: a local URI with no history (the reference);
- ``local``: the local URI with the history; ``local+q``: the same after a quarantine record
  of history step 5 (on no chain the trainer builds on);
- ``s3``: SeaweedFS S3 (started here) behind :class:`deck.testing.slow_store.LatencyProxy`
  adding ``--delay-ms`` each way (default 50: a 100 ms round trip) with the history; ``s3+q``:
  the same after the quarantine record.

Each takes a full, a delta (a warm-up: it sizes the buffer pool), then ``--deltas`` deltas,
``--every`` training steps apart, each after a ``flush()`` (nothing in flight: the moment the
code before this change listed ``quarantine/`` in the stall, and read every commit record once
a record existed). Reported: the median of the deltas' ``stall_s`` (rank 0's: the slowest
rank's) and how long the construction took (it reads the history once, for the epoch). Targets: ``local+q`` <= 1.2x ``local``, ``s3`` and ``s3+q``
<= 1.5x ``local``.

``--code DIR`` runs the ranks with the ``deck`` package of another checkout (e.g.
``git archive <commit> deck | tar -x -C /tmp/deck-old``): the "before" of a change, in the same
run's conditions (use fewer ``--deltas``: there a delta of ``s3+q`` reads the whole history
through the delay).

    python benchmarks/bench_stall_history.py [--history 10000] [--deltas 15] [--delay-ms 50]
    python benchmarks/bench_stall_history.py --code /tmp/deck-old --deltas 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.multiprocessing as mp

QUARANTINED_STEP = 5  # a history step on no chain the trainer builds on
FULL_EVERY = 100  # the history's fulls
WORKERS = 64  # concurrent requests of the S3 store (and its client's connection pool)


def _use_code(code: str | None) -> None:
    if code:
        sys.path.insert(0, code)  # its deck/ wins over the editable install (a meta path hook)


def history_records(n: int, scratch: str) -> list[tuple[str, bytes]]:
    """``(key, commit record)`` of ``n`` synthetic checkpoints (see the module docstring)."""
    from deck.format.manifest import MANIFEST, Kind, dump_model, step_dir
    from deck.storage import LocalStorage
    from deck.testing.synth import SynthTrainer

    template = SynthTrainer(LocalStorage(scratch)).save("full")
    ids = random.Random(0)
    out: list[tuple[str, bytes]] = []
    parent: tuple[int, str] | None = None
    base = 0
    for step in range(n):
        full = step % FULL_EVERY == 0
        ckpt_id = f"{ids.getrandbits(64):016x}"
        if full:
            base = step
        m = template.model_copy(
            update={
                "id": ckpt_id,
                "step": step,
                "kind": Kind.FULL if full else Kind.DELTA,
                "parent": None if full or parent is None else parent[0],
                "parent_id": None if full or parent is None else parent[1],
                "base": base,
                "epoch": 0,
                "created_unix": time.time(),
            }
        )
        out.append((f"{step_dir(step)}/{MANIFEST}", dump_model(m)))
        parent = (step, ckpt_id)
    return out


def write_local(root: str, records: list[tuple[str, bytes]]) -> None:
    for key, data in records:
        os.makedirs(os.path.join(root, os.path.dirname(key)), exist_ok=True)
        with open(os.path.join(root, key), "wb") as f:
            f.write(data)


def write_s3(uri: str, options: dict[str, Any], records: list[tuple[str, bytes]]) -> None:
    from deck.storage import open_storage

    store = open_storage(uri, options)
    with ThreadPoolExecutor(WORKERS) as pool:
        for fut in [pool.submit(store.put, key, data) for key, data in records]:
            fut.result()


def _worker(rank: int, world_size: int, port: int, a: dict[str, Any], out: str) -> None:
    _use_code(a["code"])
    import torch
    import torch.distributed as dist

    import deck
    from deck.demo import ModelSpec, build_model, train_step
    from deck.format.manifest import MANIFEST, CheckpointManifest, load_model, step_dir
    from deck.processes import end_rank, init_process_group
    from deck.read.catalog import quarantine
    from deck.storage import FsspecStorage, open_storage

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    torch.set_num_threads(1)
    init_process_group(rank, world_size, port)
    spec = ModelSpec(num_tables=a["tables"], rows=a["rows"], dim=a["dim"], batch=a["batch"])
    model, opt = build_model(spec)
    results: dict[str, Any] = {"deck": os.path.dirname(deck.__file__)}
    step = a["history"]
    for cond in a["conditions"]:
        name, uri, options = cond["name"], cond["uri"], cond["options"]
        store = (
            FsspecStorage(uri, options, max_workers=WORKERS)
            if uri.startswith("s3://")
            else open_storage(uri)
        )
        if cond["quarantine"] and rank == 0:
            key = f"{step_dir(QUARANTINED_STEP)}/{MANIFEST}"
            m = load_model(CheckpointManifest, store.get(key), key)
            quarantine(store, m, "bench: damaged")
        dist.barrier()
        config = deck.DeckConfig(
            uri=uri,
            storage_options=options,
            delta_every_steps=a["every"],
            staging=deck.StagingConfig(spool_dir=os.path.join(a["spool"], str(rank))),
        )
        t0 = time.perf_counter()
        ck = deck.DeltaCheckpointer(model, [opt], config, storage=store)
        construct = time.perf_counter() - t0
        stalls = []
        kinds = []
        try:
            for i in range(a["deltas"] + 2):
                for _ in range(a["every"] if i else 1):
                    step += 1
                    train_step(model, opt, spec, step)
                ck.flush()
                stats = ck.save("full" if i == 0 else "delta", step=step)
                assert stats is not None
                if i > 1:  # the first delta sizes the buffer pool: a warm-up
                    stalls.append(stats.stall_s)
                    kinds.append(stats.kind)
            ck.flush()
        finally:
            ck.close()
        results[name] = {"stalls": stalls, "kinds": kinds, "construct_s": construct}
        step += 1
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    end_rank()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--history", type=int, default=10_000)
    p.add_argument("--deltas", type=int, default=15)
    p.add_argument("--every", type=int, default=5, help="training steps between deltas")
    p.add_argument("--delay-ms", type=float, default=50.0, help="added each way (ms)")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--server-nice", type=int, default=10, help="the S3 server's nice level")
    p.add_argument("--no-s3", action="store_true", help="local conditions only")
    p.add_argument("--code", default=None, help="another checkout whose deck/ to run")
    a = p.parse_args(argv)
    code = os.path.abspath(a.code) if a.code else None

    from deck.processes import free_port

    work = tempfile.mkdtemp(prefix="deck-stall-history-")
    server = proxy = None
    try:
        t0 = time.perf_counter()
        records = history_records(a.history, os.path.join(work, "template"))
        local = os.path.join(work, "local")
        write_local(local, records)
        made = f"history of {a.history} commit records: built and written locally in "
        made += f"{time.perf_counter() - t0:.1f} s"
        conditions: list[dict[str, Any]] = [
            {"name": "empty", "uri": os.path.join(work, "empty"), "options": {}},
            {"name": "local", "uri": local, "options": {}},
            {"name": "local+q", "uri": local, "options": {}, "quarantine": True},
        ]
        if not a.no_s3:
            from deck.testing.s3_server import SeaweedS3
            from deck.testing.slow_store import LatencyProxy

            server = SeaweedS3(workdir=os.path.join(work, "seaweed"), nice=a.server_nice).start()
            proxy = LatencyProxy(server.ports["s3"], a.delay_ms / 1000).start()
            direct = dict(server.storage_options)
            direct["config_kwargs"] = {**direct["config_kwargs"], "max_pool_connections": WORKERS}
            slow = proxy.s3_options(direct)
            t0 = time.perf_counter()
            write_s3(server.uri("history"), direct, records)
            made += f"; to S3 in {time.perf_counter() - t0:.1f} s"
            conditions += [
                {"name": "s3", "uri": server.uri("history"), "options": slow},
                {"name": "s3+q", "uri": server.uri("history"), "options": slow, "quarantine": True},
            ]
        for c in conditions:
            c.setdefault("quarantine", False)
        args = {
            "code": code,
            "conditions": conditions,
            "spool": os.path.join(work, "spool"),
            **{k: getattr(a, k) for k in ("history", "deltas", "every")},
            **{k: getattr(a, k) for k in ("tables", "rows", "dim", "batch")},
        }
        out = os.path.join(work, "result.json")
        mp.spawn(_worker, args=(2, free_port(), args, out), nprocs=2, join=True)
        with open(out) as f:
            res = json.load(f)

        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
        print(f"date {datetime.date.today()}, commit {commit}, deck package: {res['deck']}")
        print(made)
        print(
            f"model: 2 gloo ranks, {a.tables} x {a.rows} x {a.dim}, batch {a.batch}; a delta "
            f"every {a.every} steps after a flush(); {a.deltas} deltas per condition"
        )
        if not a.no_s3:
            print(f"s3: SeaweedFS behind a {2 * a.delay_ms:.0f} ms round trip")
        ref = statistics.median(res["local"]["stalls"])
        print(f"{'condition':10} {'median':>9} {'vs local':>9} {'max':>9} {'construct':>10}  kinds")
        for c in conditions:
            r = res[c["name"]]
            med, worst = statistics.median(r["stalls"]), max(r["stalls"])
            kinds = sorted(set(r["kinds"]))
            print(
                f"{c['name']:10} {med * 1e3:7.2f}ms {med / ref:8.2f}x {worst * 1e3:7.2f}ms "
                f"{r['construct_s']:9.2f}s  {','.join(kinds)}"
            )
        checks = [("local+q", 1.2)] + ([] if a.no_s3 else [("s3", 1.5), ("s3+q", 1.5)])
        for name, goal in checks:
            ratio = statistics.median(res[name]["stalls"]) / ref
            print(
                f"target {name} <= {goal}x local: {ratio:.2f}x {'met' if ratio <= goal else 'MISSED'}"
            )
        print(
            "reproduce: python benchmarks/bench_stall_history.py " + " ".join(argv or sys.argv[1:])
        )
    finally:
        if proxy is not None:
            # Its stop cancels the connections the ranks' S3 clients left open, each of which
            # asyncio would log with a traceback
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            proxy.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
