"""GC and restore planning against the length of the history (one URI, a delta every step).

A long job's lineage is generated, not trained: :class:`deck.testing.synth_lineage.LineageSim`
makes the commit records the trainer and the merger commit, field for field (the trainer's
through ``commit_record`` with the arguments ``deck.trainer.writer.commit`` passes, the merger's
with those of ``deck.merge.build``; every rank reference names a rank manifest the real writer
wrote, stored as a hard link of one copy), without the chunks they describe, which neither GC's
dry run nor restore planning reads. The job: a delta every step, a trainer full every
``--full-every`` steps, a merger (stride ``--stride``, a merger full every ``--merger-full-every``
deltas since a full, committing ``--lag`` saves behind the trainer), a rollback of 50 steps every
``--rollback-every`` steps; one commit per second of the store's clock (each record's file time).

For each size, at a local store (medians of ``--repeats``, warm page cache):

- ``deck gc --dry-run`` with the default policy (:func:`deck.ops.retention.gc.collect_garbage`),
  its grace period covering every commit, and covering the last hour (3,600 commits); and its
  parts as GC runs them: listing the store, reading the commit records, building the lineage
  graph, the retention plan, the grace-period protection -- with the algorithm before this one
  (deck/testing/grace_reference.py: every moment planned again) alongside, up to
  ``--reference-up-to`` checkpoints, checked to protect the same ids;
- planning the restore of the latest step: ``read_manifests`` (with its listing), ``build_graph``,
  ``latest`` + ``cheapest_chain``, each timed on its own; then through the catalog; then from
  the newest segments of the catalog (``deck.read.window.read_window``, what a restore does),
  checked to plan the same chain;
- ``deck ls``'s default view (:func:`deck.ops.listing.list_recent_rows`);
- the full-history reads: ``deck ls --all --json`` as the command runs it (``deck.cli.main`` in
  this process, its output written to ``/dev/null``: all of the command but the interpreter's
  start), and reading and parsing every record through the catalog
  (:func:`deck.read.catalog.read_manifests`), each as time and records per second
  (``--full-history-only``: only these, after generating each size);

and the growth exponent between sizes (time ~ n**k). With ``--s3-up-to N``, the sizes up to N
again at the S3 test server (SeaweedFS, started here, on this host: requests are what the
numbers compare; a remote store adds its round trip to each), on a copy of the local store as
the local measurements left it: the restore plan from the newest segments, ``deck ls``'s
default view, a merger pass with nothing new (a new worker, which reads its window first) and
``deck gc --dry-run`` (grace over the last hour), each with the storage requests it made.

    python benchmarks/bench_history_scale.py [--sizes 1000,10000,100000] [--repeats 3] [--s3-up-to 10000]
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import functools
import itertools
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _workload import in_workdir

from deck.cli import main as deck_main
from deck.cli.inspect import LS_RECENT_STEPS
from deck.format.manifest import MANIFEST, parse_merged_dir, parse_step_dir
from deck.merge.worker import MergeWorker
from deck.ops.listing import list_recent_rows
from deck.ops.retention import gc as gc_module
from deck.ops.retention import view as view_module
from deck.ops.retention.gc import collect_garbage
from deck.ops.retention.plan import RetentionPolicy, grace_protected
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph, cheapest_chain, latest_checked, latest_restorable
from deck.read.window import read_window
from deck.storage import LocalStorage, Storage, open_storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.grace_reference import reference_grace_protected
from deck.testing.synth_lineage import CheckpointFiles, LineageSim, writer_checkpoint

# Names per page of an S3 listing (ListObjectsV2): what a listing costs in requests.
LIST_PAGE = 1000
# Concurrent requests of the copy to S3 (and the S3 client's connection pool).
S3_WORKERS = 64


def _median_s(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def generate(n: int, a: argparse.Namespace, files: CheckpointFiles) -> LineageSim:
    """A job's lineage of ``n`` commit records (trainer's and merger's)."""
    sim = LineageSim(files=files, seed=n)
    last = sim.save("full")
    sim.merge_blocks(last, stride=a.stride, full_every=a.merger_full_every, lag=a.lag)
    extend(sim, a, n)
    return sim


def extend(sim: LineageSim, a: argparse.Namespace, n: int) -> None:
    """The job goes on until its lineage holds ``n`` commit records."""
    while len(sim.committed_at) < n:
        saves = sim.saves  # (the first full's among them: this is the save after as many)
        if a.rollback_every and saves % a.rollback_every == 0:
            sim.rollback(sim.step - 50)  # a restore of 50 steps back: a new timeline
        sim.train()
        kind = "full" if sim.step % a.full_every == 0 else "delta"
        last = sim.save(kind)
        sim.merge_blocks(last, stride=a.stride, full_every=a.merger_full_every, lag=a.lag)


class _Split:
    """Times of GC's parts in one run: functions of deck.ops.retention.gc wrapped while it
    runs (each call's wall time added to its part)."""

    PARTS = {
        "read": (view_module, "read_manifests"),
        "graph": (gc_module, "build_graph"),
        "protect": (gc_module, "grace_protected"),
        "plan": (gc_module, "plan_lineage"),
        "checked": (gc_module._Collector, "_checked_plan"),
        "orphans": (gc_module._Collector, "collect_orphans"),
    }

    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage
        self.s: dict[str, float] = {}

    def _timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.s[part] = self.s.get(part, 0.0) + time.perf_counter() - t0

        return wrapper

    def run(self, policy: RetentionPolicy, now: float) -> tuple[dict[str, float], Any]:
        """A run over the whole store (``deck gc --whole``), its parts timed."""
        self.s = {}
        saved = {k: getattr(owner, name) for k, (owner, name) in self.PARTS.items()}
        listing = self.storage.list_modified
        try:
            for k, (owner, name) in self.PARTS.items():
                setattr(owner, name, self._timed(k, saved[k]))
            self.storage.list_modified = self._timed("list", listing)  # type: ignore[method-assign]
            t0 = time.perf_counter()
            report = collect_garbage(self.storage, policy, dry_run=True, now=now, whole=True)
            self.s["total"] = time.perf_counter() - t0
        finally:
            for k, (owner, name) in self.PARTS.items():
                setattr(owner, name, saved[k])
            del self.storage.list_modified
        self.s["checked"] -= self.s.get("plan", 0.0)  # (the plan runs inside it)
        self.s["other"] = self.s["total"] - sum(
            v for k, v in self.s.items() if k not in ("total", "other")
        )
        return self.s, report


def measure(
    n: int, a: argparse.Namespace, files: CheckpointFiles, work: str
) -> tuple[dict[str, float], LocalStorage, float]:
    t0 = time.perf_counter()
    sim = generate(n, a, files)
    storage = LocalStorage(os.path.join(work, f"run-{n}"))
    sim.write(storage, durable=False)
    total = len(sim.committed_at)
    print(
        f"{total} checkpoints ({len(sim.trainer)} trainer, {len(sim.merged)} merger) generated "
        f"and written in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    now = sim.clock + 1.0
    if a.full_history_only:
        sim.write_log(storage, a.behind, _fast_put(storage))
        return {"n": total, **measure_full_history(storage, total, a)}, storage, now
    every = RetentionPolicy(grace_s=now - min(sim.committed_at.values()) + 1.0)
    hour = RetentionPolicy(grace_s=3600.0)
    out: dict[str, float] = {"n": total}

    # Planning the restore of the latest step
    out["r_read"], manifests = _median_s(lambda: read_manifests(storage), a.repeats)
    out["r_graph"], graph = _median_s(lambda: build_graph(manifests), a.repeats)

    def chain() -> int:
        g = build_graph(manifests)  # (a fresh graph: no paths computed yet)
        t0 = time.perf_counter()
        latest = g.latest()
        assert latest is not None
        chain = cheapest_chain(g, latest)
        chain_s.append(time.perf_counter() - t0)
        return len(chain)

    chain_s: list[float] = []
    for _ in range(a.repeats):
        length = chain()
    out["r_chain"] = statistics.median(chain_s)
    out["r_total"] = out["r_read"] + out["r_graph"] + out["r_chain"]
    print(f"  latest step's chain: {length} checkpoints", flush=True)

    # The same through the catalog: the commit log the writers keep, a catalog as a merger
    # pass writes it, and --behind log entries after it (commits since the last catalog)
    out["whole_requests"] = _requests(storage)
    t0 = time.perf_counter()
    sim.write_log(storage, a.behind, _fast_put(storage))
    print(f"  commit log and catalog written in {time.perf_counter() - t0:.1f} s", flush=True)
    out["i_read"], manifests = _median_s(lambda: read_manifests(storage), a.repeats)
    assert manifests.index is not None and manifests.index.since == a.behind
    out["i_total"] = out["i_read"] + out["r_graph"] + out["r_chain"]
    out["i_requests"] = _requests(storage)
    out.update(measure_full_history(storage, total, a))

    # GC end to end, split into its parts as it runs them (medians over the repeats)
    split = _Split(storage)
    for name, policy in (("all", every), ("hour", hour)):
        runs = []
        for _ in range(a.repeats):
            parts, report = split.run(policy, now)
            runs.append(parts)
        for k in runs[0]:
            out[f"{k}_{name}"] = statistics.median(x.get(k, 0.0) for x in runs)
        # The default run: the folders of the newest steps, where the catalog allows
        out[f"gcw_{name}"], newest = _median_s(
            functools.partial(collect_garbage, storage, policy, dry_run=True, now=now),
            a.repeats,
        )
        counting = _Counting(storage)
        collect_garbage(counting, policy, dry_run=True, now=now)
        out[f"gcw_requests_{name}"] = float(counting.n)
        floor = newest.floor if newest.floor is not None else 0
        out[f"gcw_steps_{name}"] = float(sim.step - floor + 1)
        want = {d for d in report.deleted if _folder_step(d[0]) >= floor}
        assert set(newest.deleted) == want, (
            "the newest steps' run decided otherwise: only it "
            f"{sorted(set(newest.deleted) - want)[:5]}, only the whole "
            f"{sorted(want - set(newest.deleted))[:5]}"
        )
        print(
            f"  gc --dry-run, grace {name}: whole store {out[f'total_{name}']:.3f} s, would "
            f"delete {len(report.deleted)} checkpoint(s), {report.grace_held} held by the grace "
            f"period; newest steps ({newest.floor} on) {out[f'gcw_{name}']:.3f} s, "
            f"{out[f'gcw_requests_{name}']:.0f} requests, would delete {len(newest.deleted)}",
            flush=True,
        )
        if total <= a.reference_up_to:  # the protection before this one, on the same lineage
            manifests = read_manifests(storage)
            graph = build_graph(manifests)
            times = dict(storage.list_modified(""))
            committed_at = {
                cid: times.get(f"{node.folder}/{MANIFEST}") for cid, node in graph.nodes.items()
            }
            t0 = time.perf_counter()
            ref = reference_grace_protected(graph, policy, now, committed_at)
            out[f"ref_protect_{name}"] = time.perf_counter() - t0
            new = grace_protected(build_graph(manifests), policy, now, committed_at)
            assert new == ref, f"grace {name}: not the reference's decisions"

    # Restore planning from the newest segments (what a restore of the latest step reads)
    def windowed() -> list[str]:
        got = read_window(storage)
        assert got is not None  # (a short history: one segment, read whole)
        latest = latest_restorable(got)
        assert latest is not None
        # (what the restore checks before taking it: nothing newer given up)
        check = latest_checked(storage, got, latest)
        assert check.gives_up is None and check.step == latest, check.gives_up
        return [m.id for m in cheapest_chain(build_graph(got), latest)]

    out["w_total"], w_chain = _median_s(windowed, a.repeats)
    whole = build_graph(manifests)
    latest = whole.latest()
    assert latest is not None
    assert w_chain == [m.id for m in cheapest_chain(whole, latest)], "a window planned another"
    counting = _Counting(storage)
    got = read_window(counting)
    assert got is not None
    out["w_requests"] = float(counting.n)
    out["w_records"] = float(len(got) + len(got.merged))

    # `deck ls`'s default view (the newest steps and the fulls of the newest segments)
    out["ls_total"], recent = _median_s(
        lambda: list_recent_rows(storage, LS_RECENT_STEPS), a.repeats
    )
    assert recent is not None, "the default view read every record"
    counting = _Counting(storage)
    list_recent_rows(counting, LS_RECENT_STEPS)
    out["ls_requests"] = float(counting.n)
    at_positions(sim, storage, a, out)
    worker = MergeWorker(storage)
    # Catching up on what the generator left for the merger: passes until one has nothing to
    # do. (A merger full over generated inputs, whose rank manifests are copies of one real
    # checkpoint's, fails its retries and then waits out its back-off, as any failing item.)
    for _ in range(4 * (worker.max_failures + 2)):
        caught_up = worker.run_pass()
        if not caught_up.progressed and not caught_up.stats.failed:
            break
    # (five passes at least: one may still be a failing item's retry)
    out["i_merge"], _ = _median_s(worker.run_pass, max(5, a.repeats))
    print(
        f"  read through the catalog: {out['i_read']:.3f} s, {out['i_requests']:.0f} requests "
        f"(every record: {out['r_read']:.3f} s, {out['whole_requests']:.0f} requests)",
        flush=True,
    )
    return out, storage, now


# What depends on where the history ends rather than on its length: the size of the catalog's
# newest segment (cut where a step's hash says: ~256 steps, of random length) and of the grace
# period's window. Measured where the history ends and --positions - 1 times again as it goes on.
MOVING = (
    *("w_total", "w_requests", "w_records", "ls_total", "ls_requests"),
    *(f"gcw{x}_{g}" for x in ("", "_requests", "_steps") for g in ("all", "hour")),
)


def at_positions(
    sim: LineageSim, storage: LocalStorage, a: argparse.Namespace, out: dict[str, float]
) -> None:
    """The operations of :data:`MOVING` again after the job went on by ``--position-records``
    commits (the writers' commit log and a catalog written as they write them), ``--positions``
    places in all: each figure is their median; the spread is printed."""
    seen = {k: [out[k]] for k in MOVING}
    for _ in range(a.positions - 1):
        extend(sim, a, len(sim.committed_at) + a.position_records)
        sim.write(storage, durable=False, only_new=True)
        sim.write_log(storage, a.behind, _fast_put(storage), only_new=True)
        now = sim.clock + 1.0
        every = RetentionPolicy(grace_s=now - min(sim.committed_at.values()) + 1.0)
        for name, policy in (("all", every), ("hour", RetentionPolicy(grace_s=3600.0))):
            t, newest = _median_s(
                functools.partial(collect_garbage, storage, policy, dry_run=True, now=now),
                a.repeats,
            )
            seen[f"gcw_{name}"].append(t)
            counting = _Counting(storage)
            collect_garbage(counting, policy, dry_run=True, now=now)
            seen[f"gcw_requests_{name}"].append(float(counting.n))
            floor = newest.floor if newest.floor is not None else 0
            seen[f"gcw_steps_{name}"].append(float(sim.step - floor + 1))
        t, got = _median_s(lambda: read_window(storage), a.repeats)
        assert got is not None
        seen["w_total"].append(t)  # (the read: what grows with the window)
        counting = _Counting(storage)
        got = read_window(counting)
        assert got is not None
        seen["w_requests"].append(float(counting.n))
        seen["w_records"].append(float(len(got) + len(got.merged)))
        t, _ = _median_s(lambda: list_recent_rows(storage, LS_RECENT_STEPS), a.repeats)
        seen["ls_total"].append(t)
        counting = _Counting(storage)
        list_recent_rows(counting, LS_RECENT_STEPS)
        seen["ls_requests"].append(float(counting.n))
    for k, xs in seen.items():
        out[k] = statistics.median(xs)
    print(
        f"  at {a.positions} places (every {a.position_records} commits): "
        + "; ".join(
            f"{k} {min(xs):.3g}..{max(xs):.3g}"
            for k, xs in seen.items()
            if k in ("w_total", "w_records", "ls_total", "gcw_all", "gcw_hour")
        ),
        flush=True,
    )


def measure_full_history(
    storage: LocalStorage, total: int, a: argparse.Namespace
) -> dict[str, float]:
    """The readers of every record: ``deck ls --all --json`` end to end (the CLI's own function,
    its output written to /dev/null), and :func:`read_manifests` through the catalog; each
    with the records it handled per second."""
    out: dict[str, float] = {}

    def ls_all() -> int:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            return deck_main(["ls", storage.root, "--all", "--json"])

    # The process's CPU time too: on a shared 2-core VM the wall time is mostly what the other
    # jobs leave, the CPU time what the command costs.
    c0 = time.process_time()
    out["fh_ls"], code = _median_s(ls_all, a.repeats)
    out["fh_ls_cpu"] = (time.process_time() - c0) / a.repeats
    assert code == 0, f"deck ls --all --json exited {code}"
    c0 = time.process_time()
    out["fh_read"], got = _median_s(lambda: read_manifests(storage), a.repeats)
    out["fh_read_cpu"] = (time.process_time() - c0) / a.repeats
    assert got.index is not None, "not read through the catalog"
    assert len(got) + len(got.merged) == total, "not every record"
    out["fh_ls_rate"] = total / out["fh_ls"]
    out["fh_read_rate"] = total / out["fh_read"]
    print(
        f"  deck ls --all --json: {out['fh_ls']:.3f} s ({out['fh_ls_rate']:,.0f} records/s); "
        f"every record through the catalog: {out['fh_read']:.3f} s "
        f"({out['fh_read_rate']:,.0f} records/s); CPU {out['fh_ls_cpu']:.3f} s / "
        f"{out['fh_read_cpu']:.3f} s",
        flush=True,
    )
    return out


def measure_s3(
    n: int, local: LocalStorage, now: float, a: argparse.Namespace, server: Any
) -> dict[str, float]:
    """The routine operations at the S3 test server, on a copy of the local store as
    :func:`measure` left it (commit log, catalog, the merger caught up), and at the local store
    in that same state: each timed, with the requests it made (a listing: one per 1,000 names)."""
    uri = server.uri(f"history-{n}")
    options = dict(server.storage_options)
    options["config_kwargs"] = {**options["config_kwargs"], "max_pool_connections": S3_WORKERS}
    s3 = open_storage(uri, options)
    t0 = time.perf_counter()
    keys = local.list("")
    with ThreadPoolExecutor(S3_WORKERS) as pool:
        for fut in [pool.submit(_copy, local, s3, k) for k in keys]:
            fut.result()
    print(f"  {len(keys)} objects copied to {uri} in {time.perf_counter() - t0:.1f} s", flush=True)
    out: dict[str, float] = {}

    def timed(key: str, fn: Callable[[Storage], object]) -> None:
        for where, store in (("local", local), ("s3", s3)):
            counting = _Counting(store)
            fn(counting)  # (the requests of one run; the time: median over the repeats)
            out[f"{where}_{key}_requests"] = float(counting.n)
            out[f"{where}_{key}_total"], _ = _median_s(functools.partial(fn, store), a.repeats)

    timed("w", read_window)
    timed("ls", lambda st: list_recent_rows(st, LS_RECENT_STEPS))
    timed("merge", lambda st: MergeWorker(st).run_pass())
    hour = RetentionPolicy(grace_s=3600.0)
    timed("gc", lambda st: collect_garbage(st, hour, dry_run=True, now=now))
    for key in ("w", "ls", "merge", "gc"):
        print(
            f"  {key}: local {out[f'local_{key}_total']:.3f} s "
            f"({out[f'local_{key}_requests']:.0f} requests), S3 {out[f's3_{key}_total']:.3f} s "
            f"({out[f's3_{key}_requests']:.0f} requests)",
            flush=True,
        )
    return out


def _folder_step(label: str) -> int:
    """The step of a GC report's folder label (a step folder, or a merger folder)."""
    head, _, rest = label.split(" ")[0].partition("/")
    step = parse_step_dir(head)
    if step is not None:
        return step
    parsed = parse_merged_dir(rest.rstrip("/"))
    assert parsed is not None, label
    return parsed[1]


def _copy(src: Storage, dst: Storage, key: str) -> None:
    dst.put(key, src.get(key))


class _Counting(StorageWrapper):
    """Counts the requests a reader makes (a read, a size or time asked: one each; a batch
    read: one per key; a listing: one per 1,000 names, as S3 pages it)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.n = 0

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self.n += 1
        return super().get(path, start, end)

    def get_many(self, paths: list[str], limit: int | None = None) -> Any:
        self.n += len(paths)
        return super().get_many(paths, limit)

    def get_or_none(self, path: str, limit: int | None = None) -> bytes | None:
        self.n += 1
        return super().get_or_none(path, limit)

    def iter_get(self, paths: list[str]) -> Any:
        self.n += len(paths)
        return super().iter_get(paths)

    def size(self, path: str) -> int:
        self.n += 1
        return super().size(path)

    def exists(self, path: str) -> bool:
        self.n += 1
        return super().exists(path)

    def modified(self, path: str) -> float | None:
        self.n += 1
        return super().modified(path)

    def _listed(self, names: list[Any]) -> None:
        self.n += max(1, -(-len(names) // LIST_PAGE))

    def list_modified(self, prefix: str = "") -> list[tuple[str, float | None]]:
        got = super().list_modified(prefix)
        self._listed(got)
        return got

    def list(self, prefix: str = "") -> list[str]:
        got = super().list(prefix)
        self._listed(got)
        return got

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        got = super().list_dir(prefix)
        self._listed(got)
        return got

    def list_dir_after(self, prefix: str, after: str) -> builtins.list[str]:
        got = super().list_dir_after(prefix, after)
        self._listed(got)
        return got


def _requests(storage: LocalStorage) -> float:
    """Storage requests of one ``read_manifests``."""
    counting = _Counting(storage)
    read_manifests(counting)
    return float(counting.n)


def _fast_put(storage: LocalStorage) -> Callable[[str, bytes], None]:
    """Files written straight into the store's folder (no fsync: a generated history)."""

    def put(key: str, data: bytes) -> None:
        path = storage.local_path(key)
        assert path is not None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    return put


ROWS = [
    ("gcw_all", "`deck gc --dry-run`, grace covering every commit"),
    ("gcw_requests_all", "- storage requests"),
    ("gcw_steps_all", "- steps whose folders it looked at"),
    ("gcw_hour", "`deck gc --dry-run`, grace covering the last hour"),
    ("gcw_requests_hour", "- storage requests"),
    ("gcw_steps_hour", "- steps whose folders it looked at"),
    ("total_all", "`deck gc --dry-run --whole`, grace covering every commit"),
    ("total_hour", "`deck gc --dry-run --whole`, grace covering the last hour"),
    ("list_hour", "- listing the store (`list_modified`)"),
    ("read_hour", "- reading the commit records (`read_manifests`)"),
    ("graph_hour", "- lineage graph (`build_graph`)"),
    ("protect_hour", "- grace-period protection"),
    ("ref_protect_hour", "  (before: every moment planned again)"),
    ("plan_hour", "- retention plan (`plan_lineage`)"),
    ("checked_hour", "- checks of what it relies on (replacements, takeovers)"),
    ("orphans_hour", "- orphans (each merger folder's rank manifests read)"),
    ("other_hour", "- the rest"),
    ("protect_all", "grace-period protection, grace covering every commit"),
    ("ref_protect_all", "  (before: every moment planned again)"),
    ("r_total", "planning the restore of the latest step"),
    ("r_read", "- `read_manifests` (with its listing)"),
    ("r_graph", "- `build_graph`"),
    ("r_chain", "- `latest` + `cheapest_chain`"),
    ("whole_requests", "storage requests to read every record"),
    ("i_total", "planning the restore of the latest step, through the catalog"),
    ("i_read", "- `read_manifests` through the catalog"),
    ("i_requests", "storage requests to read through the catalog"),
    (
        "w_total",
        "planning the restore of the latest step, from the newest segments (and the check of what it passes by)",
    ),
    ("w_requests", "storage requests of that plan"),
    ("w_records", "records it read (the newest segments back to the full its chain needs)"),
    ("ls_total", "`deck ls` (default view: newest steps, fulls of the newest segments)"),
    ("ls_requests", "storage requests of that view"),
    ("fh_ls", "`deck ls --all --json` (every record, end to end but the interpreter's start)"),
    ("fh_ls_rate", "- records/s"),
    ("fh_ls_cpu", "- CPU time of the process (mean of the repeats)"),
    ("fh_read", "every record read and parsed through the catalog (`read_manifests`)"),
    ("fh_read_rate", "- records/s"),
    ("fh_read_cpu", "- CPU time of the process (mean of the repeats)"),
    ("i_merge", "a merger pass with nothing new, through the catalog"),
    (
        "local_w_total",
        "same store state, local: planning the restore of the latest step, from the newest segments",
    ),
    (
        "s3_w_total",
        "same store state, S3: planning the restore of the latest step, from the newest segments",
    ),
    ("s3_w_requests", "- storage requests (S3)"),
    ("local_ls_total", "same store state, local: `deck ls` (default view)"),
    ("s3_ls_total", "same store state, S3: `deck ls` (default view)"),
    ("s3_ls_requests", "- storage requests (S3)"),
    (
        "local_merge_total",
        "same store state, local: a merger pass with nothing new (a new worker: reads its window first)",
    ),
    (
        "s3_merge_total",
        "same store state, S3: a merger pass with nothing new (a new worker: reads its window first)",
    ),
    ("s3_merge_requests", "- storage requests (S3)"),
    (
        "local_gc_total",
        "same store state, local: `deck gc --dry-run`, grace covering the last hour",
    ),
    ("s3_gc_total", "same store state, S3: `deck gc --dry-run`, grace covering the last hour"),
    ("s3_gc_requests", "- storage requests (S3)"),
]


def table(results: list[dict[str, float]]) -> str:
    sizes = [int(x["n"]) for x in results]
    head = "| | " + " | ".join(f"{s:,} ckpts" for s in sizes)
    pairs = list(itertools.pairwise(sizes))
    head += "".join(f" | k {a // 1000}k->{b // 1000}k" for a, b in pairs) + " |"
    lines = [head, "|---" * (1 + len(sizes) + len(pairs)) + "|"]
    for key, label in ROWS:
        if not any(key in x for x in results):
            continue  # (a part not measured in this run)
        count = key.endswith(("requests", "records")) or "_steps_" in key or "_requests_" in key
        rate = key.endswith("_rate")  # (records/s: no growth exponent, that of its time is)
        cells = [
            (f"{x[key]:,.0f}" if rate else f"{x[key]:.0f}" if count else f"{x[key]:.3f} s")
            if key in x
            else "-"
            for x in results
        ]
        ks = []
        for (x, y), (sa, sb) in zip(itertools.pairwise(results), pairs, strict=True):
            if not rate and key in x and key in y and x[key] > 0 and y[key] > 0:
                ks.append(f"{math.log(y[key] / x[key]) / math.log(sb / sa):.2f}")
            else:
                ks.append("-")
        lines.append(f"| {label} | " + " | ".join(cells + ks) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reference-up-to", type=int, default=10000)
    p.add_argument("--full-every", type=int, default=100)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--merger-full-every", type=int, default=64)
    p.add_argument("--lag", type=int, default=5)
    p.add_argument("--rollback-every", type=int, default=10000)
    p.add_argument("--behind", type=int, default=100, help="log entries after the catalog")
    p.add_argument(
        "--positions",
        type=int,
        default=5,
        help="where the history ends: the operations whose cost depends on it are measured at "
        "this many places, --position-records commits apart (medians)",
    )
    p.add_argument("--position-records", type=int, default=150)
    p.add_argument(
        "--s3-up-to",
        type=int,
        default=0,
        help="also measure at the S3 test server (SeaweedFS, started here) the sizes up to this",
    )
    p.add_argument(
        "--full-history-only",
        action="store_true",
        help="measure only the full-history reads (deck ls --all --json, every record through "
        "the catalog)",
    )
    p.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    a = p.parse_args(argv)
    cmd = "python benchmarks/bench_history_scale.py " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)
    )
    print(cmd, flush=True)

    def run(work: str) -> int:
        files = writer_checkpoint()
        server = None
        if a.s3_up_to:
            from deck.testing.s3_server import SeaweedS3

            server = SeaweedS3(workdir=os.path.join(work, "seaweed")).start()
        try:
            results = []
            for size in (int(x) for x in a.sizes.split(",")):
                out, local, now = measure(size, a, files, work)
                if server is not None and size <= a.s3_up_to:
                    out.update(measure_s3(size, local, now, a, server))
                results.append(out)
        finally:
            if server is not None:
                server.stop()
        print()
        print(cmd)
        print(table(results))
        return 0

    return in_workdir(a.out, "deck-bench-history-scale-", run)


if __name__ == "__main__":
    sys.exit(main())
