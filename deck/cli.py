"""The ``deck`` command line.

    deck ls URI [--json]                 committed checkpoints and their lineage
    deck verify URI [--step N | --all]   re-read every file, check every checksum
    deck lineage URI [--json] [--step N] the lineage graph and the cheapest chain of a step
    deck merge URI [--once | --follow]   merger worker(s): hierarchical merging and new fulls
    deck gc URI [--dry-run]              retention: delete what no retained step needs

Exit codes: 0 ok, 1 a check failed (corruption found, nothing to list, merge work left
waiting or failed), 2 usage or access error.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from deck.catalog import latest_restorable, list_checkpoints, quarantine, read_manifests
from deck.errors import ConfigError, DeckError
from deck.storage import open_storage
from deck.verify import verify_checkpoint


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def cmd_ls(a: argparse.Namespace) -> int:
    infos = list_checkpoints(a.uri)
    if a.json:
        print(json.dumps([asdict(i) for i in infos], indent=1))
        return 0
    if not infos:
        print(f"no committed checkpoints at {a.uri}")
        return 0
    print(
        f"{'step':>10} {'kind':>6} {'parent':>8} {'base':>8} {'epoch':>5} {'ranks':>5} {'bytes':>11}  id"
    )
    for i in infos:
        parent = "-" if i.parent is None else str(i.parent)
        print(
            f"{i.step:>10} {i.kind:>6} {parent:>8} {i.base:>8} {i.epoch:>5} {i.ranks:>5} {_human(i.bytes):>11}  {i.id}"
        )
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    storage = open_storage(a.uri)
    manifests = read_manifests(storage)
    if not manifests:
        print(f"no committed checkpoints at {a.uri}", file=sys.stderr)
        return 1
    if a.all:
        targets = [manifests[s] for s in sorted(manifests)] + sorted(
            manifests.merged.values(), key=lambda m: (m.step, m.layer, m.id)
        )
    else:
        step = a.step if a.step is not None else latest_restorable(manifests)
        if step is None or step not in manifests:
            print(
                f"no committed checkpoint at step {a.step} in {a.uri}; have {sorted(manifests)}",
                file=sys.stderr,
            )
            return 1
        targets = [manifests[step]]
    bad = 0
    t0 = time.perf_counter()
    for m in targets:
        label = f"step {m.step}" if not m.is_merged else f"{m.kind.value} {m.folder}"
        bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(desc=f"verify {label}", unit="B", unit_scale=True, leave=False)
        report = verify_checkpoint(storage, m, progress=bar.update if bar else None)
        if bar:
            bar.close()
        status = "ok" if not report.problems else f"{len(report.problems)} problem(s)"
        print(f"{label}: {report.files} files, {_human(report.bytes)}: {status}")
        for p in report.problems:
            print(f"  BAD {p}")
        if report.problems and a.quarantine:
            quarantine(storage, m, report.problems[0])
            print("  quarantined: restores and the merger will not use it")
        bad += bool(report.problems)
    print(
        f"verified {len(targets)} checkpoint(s) in {time.perf_counter() - t0:.1f} s; {bad} with problems"
    )
    return 1 if bad else 0


def cmd_lineage(a: argparse.Namespace) -> int:
    from deck.lineage import chain_bytes, cheapest_chain, lineage

    graph = lineage(a.uri)
    if not graph.nodes:
        print(f"no committed checkpoints at {a.uri}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(graph.to_dict(), indent=1))
        return 0
    print(f"{'kind':>6} {'layer':>5} {'covers':>21} {'epoch':>5} {'bytes':>11}  id / folder")
    for n in sorted(graph.nodes.values(), key=lambda n: (n.step, n.first_step, n.layer, n.id)):
        covers = f"{n.covers[0]}..{n.covers[1]}" if n.covers[0] != n.covers[1] else str(n.step)
        flag = f"  QUARANTINED: {n.quarantined}" if n.quarantined else ""
        print(
            f"{n.kind.value:>6} {n.layer:>5} {covers:>21} {n.epoch:>5} {_human(n.bytes):>11}  "
            f"{n.id} {n.folder}{flag}"
        )
    step = a.step if a.step is not None else graph.latest()
    if step is None:
        print("no restorable step")
        return 1
    chain = cheapest_chain(graph, step)
    total = chain_bytes(chain)
    print(f"cheapest chain of step {step} ({len(chain)} checkpoints, {_human(total)}):")
    for m in chain:
        print(f"  {m.kind.value:>6} {m.covers[0]}..{m.covers[1]}  {m.folder}")
    return 0


def _merge_config(a: argparse.Namespace, worker_index: int, num_workers: int) -> Any:
    from deck.merger import FullPolicy, MergeConfig

    return MergeConfig(
        stride=a.stride,
        full=FullPolicy(
            every=a.full_every,
            max_live_fraction=None if a.full_live_fraction <= 0 else a.full_live_fraction,
            cost_ratio=a.full_cost_ratio,
        ),
        chunk_bytes=a.chunk_bytes,
        worker_index=worker_index,
        num_workers=num_workers,
    )


def _retention(a: argparse.Namespace) -> Any:
    from deck.retention import RetentionPolicy

    return RetentionPolicy(
        keep_last_fulls=a.keep_last_fulls,
        keep_fulls_every=a.keep_fulls_every,
        keep_all_steps=a.keep_all_steps,
        grace_s=a.grace,
    )


def _run_worker(
    a: argparse.Namespace,
    worker_index: int,
    num_workers: int,
    report: Any = None,
) -> int:
    """One merger worker in this process; returns its exit code. ``report(kind, stats)`` gets
    progress events."""
    from deck.merger import MergeWorker
    from deck.retention import collect_garbage

    storage = open_storage(a.uri)
    config = _merge_config(a, worker_index, num_workers)
    after_pass = None
    if a.gc and worker_index == 0:
        policy = _retention(a)

        def after_pass(_manifests: Any) -> None:
            collect_garbage(storage, policy)

    worker = MergeWorker(storage, config, after_pass=after_pass, progress=report)
    if a.follow:
        stop = threading.Event()

        def on_signal(signum: int, _frame: Any) -> None:
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        worker.follow(stop, poll_s=a.poll)
        return 0
    stats, waiting = worker.run_once(wait_s=a.wait)
    return 1 if waiting or stats.failed or worker.failures else 0


def _child(a: argparse.Namespace, index: int, num: int, queue: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = _run_worker(
            a, index, num, lambda kind, st: queue.put((kind, st.bytes_written, st.items_committed))
        )
    except DeckError as e:
        print(f"deck merge (worker {index} of {num}): {e}", file=sys.stderr)
        code = 2
    queue.put(("exit", index, code))


def cmd_merge(a: argparse.Namespace) -> int:
    if (a.worker_index is None) != (a.num_workers is None):
        raise ConfigError("--worker-index and --num-workers go together")
    first, hosts = (a.worker_index or 0), (a.num_workers or 1)
    if not 0 <= first < hosts:
        raise ConfigError(f"--worker-index {first} must be in [0, --num-workers {hosts})")
    k = a.workers
    if k < 1:
        raise ConfigError(f"--workers must be >= 1, got {k}")
    _merge_config(a, 0, 1)  # validate the options before starting anything
    indices = [first * k + j for j in range(k)]
    total = hosts * k
    t0 = time.perf_counter()
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(desc="deck merge", unit=" ckpt", leave=False)
    committed = 0
    if k == 1:

        def report(kind: str, _stats: Any) -> None:
            nonlocal committed
            if kind == "commit":
                committed += 1
                if bar:
                    bar.update(1)

        code = _run_worker(a, indices[0], total, report)
    else:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(a, i, total, queue)) for i in indices]
        for p in procs:
            p.start()
        codes: dict[int, int] = {}
        try:
            while len(codes) < len(procs):
                try:
                    kind, x, y = queue.get(timeout=0.5)
                except Exception:  # queue.Empty: check for workers that died without a word
                    for i, p in zip(indices, procs, strict=True):
                        if not p.is_alive() and i not in codes and p.exitcode not in (0, None):
                            codes[i] = 2
                    continue
                if kind == "exit":
                    codes[x] = y
                elif kind == "commit":
                    committed += 1
                    if bar:
                        bar.update(1)
        except KeyboardInterrupt:
            for p in procs:
                p.terminate()
        for p in procs:
            p.join()
        code = max(codes.values(), default=2)
    if bar:
        bar.close()
    print(
        f"deck merge: {committed} checkpoint(s) committed by {k} worker(s) "
        f"(of {total}) in {time.perf_counter() - t0:.1f} s"
        + ("; some work is left (see the warnings above)" if code == 1 else "")
    )
    return code


def cmd_gc(a: argparse.Namespace) -> int:
    from deck.retention import collect_garbage

    storage = open_storage(a.uri)
    rep = collect_garbage(storage, _retention(a), dry_run=a.dry_run)
    verb = "would delete" if a.dry_run else "deleted"
    if rep.latest is None:
        print(f"no restorable checkpoint at {a.uri}: nothing deleted but orphans")
    else:
        steps = rep.retained_steps
        shown = ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "")
        print(f"latest step {rep.latest}; {len(steps)} step(s) stay restorable: {shown}")
    for folder, why in rep.deleted:
        print(f"  {verb} {folder}: {why}")
    for prefix, why in rep.orphans:
        print(f"  {verb} {prefix}: {why}")
    for e in rep.errors:
        print(f"  ERROR {e}", file=sys.stderr)
    print(
        f"{verb} {len(rep.deleted)} checkpoint(s) and {len(rep.orphans)} orphan(s): "
        f"{rep.files} files, {_human(rep.bytes)}"
    )
    return 1 if rep.errors else 0


def _add_retention_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keep-last-fulls", type=int, default=2, help="newest fulls kept for rollback (2)"
    )
    p.add_argument(
        "--keep-fulls-every",
        type=int,
        default=None,
        metavar="N",
        help="also keep the oldest full of every N-step period (rollback past bad data)",
    )
    p.add_argument(
        "--keep-all-steps",
        action="store_true",
        help="keep every currently restorable step restorable",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="S",
        help="never delete what the lineage needed S seconds ago, nor files younger (3600)",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="deck", description="Inspect, check, merge and collect deck checkpoints."
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list committed checkpoints")
    ls.add_argument("uri")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_ls)
    ver = sub.add_parser("verify", help="re-read files and check checksums")
    ver.add_argument("uri")
    g = ver.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="one step (default: the latest restorable)")
    g.add_argument("--all", action="store_true", help="every committed checkpoint")
    ver.add_argument(
        "--quarantine",
        action="store_true",
        help="record damaged checkpoints so restores and the merger avoid them",
    )
    ver.set_defaults(fn=cmd_verify)

    lin = sub.add_parser("lineage", help="the lineage graph and the cheapest chain of a step")
    lin.add_argument("uri")
    lin.add_argument("--json", action="store_true", help="machine-readable graph")
    lin.add_argument("--step", type=int, help="chain of this step (default: the latest)")
    lin.set_defaults(fn=cmd_lineage)

    mer = sub.add_parser("merge", help="run merger worker(s): merged deltas and new fulls")
    mer.add_argument("uri")
    mode = mer.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="catch up and exit (default)")
    mode.add_argument("--follow", action="store_true", help="keep merging until interrupted")
    mer.add_argument("--stride", type=int, default=4, help="items per merge, s (4)")
    mer.add_argument(
        "--full-every", type=int, default=None, metavar="N", help="new full every N deltas"
    )
    mer.add_argument(
        "--full-live-fraction",
        type=float,
        default=0.1,
        metavar="F",
        help="new full when a restore reads more than F x a full on top of it (0.1; 0: off)",
    )
    mer.add_argument(
        "--full-cost-ratio",
        type=float,
        default=None,
        metavar="R",
        help="IncrCP-style rule: new full when live x R >= 2 x full + live",
    )
    mer.add_argument(
        "--chunk-bytes", type=int, default=4 * 1024 * 1024, help="chunk size of merged files"
    )
    mer.add_argument("--workers", type=int, default=1, help="worker processes to run here (1)")
    mer.add_argument("--worker-index", type=int, default=None, help="this host's index")
    mer.add_argument("--num-workers", type=int, default=None, help="hosts running workers")
    mer.add_argument("--gc", action="store_true", help="worker 0 also runs GC after each pass")
    mer.add_argument("--poll", type=float, default=5.0, help="--follow: seconds between scans")
    mer.add_argument(
        "--wait",
        type=float,
        default=60.0,
        help="--once: seconds to wait for other workers' partitions (60)",
    )
    _add_retention_args(mer)
    mer.set_defaults(fn=cmd_merge)

    gc = sub.add_parser("gc", help="delete what no retained step needs (retention)")
    gc.add_argument("uri")
    gc.add_argument("--dry-run", action="store_true", help="only report what would go")
    _add_retention_args(gc)
    gc.set_defaults(fn=cmd_gc)

    a = p.parse_args(argv)
    if a.cmd in ("merge", "gc"):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(a.fn(a))
    except DeckError as e:
        print(f"deck {a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
