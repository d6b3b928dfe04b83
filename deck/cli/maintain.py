"""Subcommands that change a URI in the background of training: ``deck merge`` (merger workers, on one host or from a launcher's variables) and ``deck gc``."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from deck.cli.common import (
    Subparsers,
    budget,
    flags_of,
    human,
    open_existing,
    poll_seconds,
    progress_bar,
    say_damaged,
    seconds,
)
from deck.cli.stopping import (
    hold_stop_signals,
    stop_on_signals,
    stop_signals_blocked,
    unblock_stop_signals,
)

# Command modules are imported inside each cmd_*: `deck ls` must not pay for (or need) torch.
from deck.errors import CheckpointNotFoundError, ClockSkewError, ConfigError, DeckError
from deck.storage import open_storage

logger = logging.getLogger(__name__)


def _merge_config(a: argparse.Namespace, worker_index: int, num_workers: int) -> Any:
    """The flags of :func:`_add_merge_config_args` as a MergeConfig (--full-live-fraction 0:
    off)."""
    from deck.merge.policy import FullPolicy, MergeConfig

    if not a.full_live_fraction >= 0:  # (NaN too)
        raise ConfigError(f"--full-live-fraction must be >= 0 (0: off), got {a.full_live_fraction}")
    with flags_of("MergeConfig", MergeConfig, FullPolicy):
        return MergeConfig(
            stride=a.stride,
            full=FullPolicy(
                every=a.full_every or None,  # 0: off, as for the other rules
                max_live_fraction=None if a.full_live_fraction <= 0 else a.full_live_fraction,
                cost_ratio=a.full_cost_ratio,
            ),
            chunk_bytes=a.chunk_bytes,
            worker_index=worker_index,
            num_workers=num_workers,
        )


def _retention(a: argparse.Namespace) -> Any:
    from deck.ops.retention import RetentionPolicy

    if a.max_clock_skew < 0 and a.max_clock_skew != -1:
        raise ConfigError(
            f"--max-clock-skew must be >= 0, or -1 for no bound; got {a.max_clock_skew:g}"
        )
    with flags_of("RetentionPolicy", RetentionPolicy):
        return RetentionPolicy(
            keep_last_fulls=a.keep_last_fulls,
            keep_fulls_every=a.keep_fulls_every,
            keep_all_steps=a.keep_all_steps,
            keep_merged_deltas=a.keep_merged_deltas,
            chain_delta_budget=a.chain_delta_budget or None,
            grace_s=a.grace,
            verify_replacements=a.verify_replacements,
            drop_quarantined=a.drop_quarantined,
            max_clock_skew_s=None if a.max_clock_skew == -1 else a.max_clock_skew,
        )


def gc_schedule(every: int, whole_every: int) -> Callable[[], bool | None]:
    """For ``deck merge --gc``: called after each pass, says whether GC runs now (None: not)
    and over the whole store (True) or the newest steps (False): after every ``every``-th pass,
    the first run and every ``whole_every``-th over the whole store (what a run of the newest
    steps leaves below them waits for such a run)."""
    if every < 1 or whole_every < 1:
        raise ConfigError(
            f"--gc-every and --gc-whole-every must be >= 1 (got {every}, {whole_every})"
        )
    passes, runs = itertools.count(), itertools.count()

    def now() -> bool | None:
        if next(passes) % every:
            return None
        return next(runs) % whole_every == 0

    return now


def _run_worker(
    a: argparse.Namespace,
    worker_index: int,
    num_workers: int,
    report: Any = None,
    stop: threading.Event | None = None,
) -> int:
    """One merger worker in this process; returns its exit code. ``report(kind, stats)`` gets
    progress events. ``stop``: what ends a --follow worker (None: SIGINT / SIGTERM here)."""
    from deck.merge.worker import MergeWorker
    from deck.ops.retention import collect_garbage

    # What each pass merged and what --gc deleted: one INFO line each (docs/operations.md)
    for name in ("deck.merge.worker", "deck.ops.retention.gc"):
        logging.getLogger(name).setLevel(logging.INFO)
    storage = open_storage(a.uri, a.storage_options)
    config = _merge_config(a, worker_index, num_workers)
    after_pass = None
    if a.gc and worker_index == 0:
        policy = _retention(a)
        schedule = gc_schedule(a.gc_every, a.gc_whole_every)

        def after_pass(_manifests: Any) -> None:
            whole = schedule()
            if whole is None:
                return
            try:
                collect_garbage(storage, policy, whole=whole)
            except ClockSkewError as e:  # merging goes on; GC waits for a sane clock
                logging.getLogger("deck.ops.retention.gc").warning("deck merge --gc: %s", e)

    worker = MergeWorker(storage, config, after_pass=after_pass, progress=report)
    if a.follow:
        if stop is not None:
            worker.follow(stop, poll_s=a.poll)
            return 0
        stop = threading.Event()
        with stop_on_signals(stop):
            worker.follow(stop, poll_s=a.poll)
        return 0
    stats, waiting = worker.run_once(wait_s=a.wait)
    damaged = say_damaged(
        "merge", a.uri, worker.damaged_records, "what builds on them is not merged"
    )
    if waiting and worker.storage_error is not None:
        # The store failed the pass (down, unreachable, refusing writes): exit 2 with its error
        # (a break-it finding: a read-only store exited 1, "some work is left")
        raise worker.storage_error
    return 1 if waiting or stats.failed or worker.failures or damaged else 0


def _child(a: argparse.Namespace, index: int, num: int, events: Any, parent: int) -> None:
    from deck.child_process import die_with_parent

    # A `deck merge` killed with -9 stops its workers too (SIGTERM: a --follow worker ends
    # after its pass, as when stopped by hand)
    die_with_parent(parent, signal.SIGTERM)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def say(kind: str, x: int, y: int) -> None:
        events.send_bytes(json.dumps([kind, x, y]).encode())

    try:
        # (started with SIGINT / SIGTERM blocked: a stop that came meanwhile arrives now)
        with stop_on_signals(stop) if a.follow else contextlib.nullcontext():
            unblock_stop_signals()
            try:
                code = _run_worker(
                    a,
                    index,
                    num,
                    lambda kind, st: say(kind, st.bytes_written, st.items_committed),
                    stop if a.follow else None,
                )
            finally:
                if a.follow:  # (seen as an exit 130 "stopped before it could say so")
                    hold_stop_signals()
    except DeckError as e:
        print(f"deck merge (worker {index} of {num}): {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # (a --once worker, interrupted)
        code = 130
    say("exit", index, code)


def cmd_merge(a: argparse.Namespace) -> int:
    """Run ``deck merge`` with parsed arguments ``a``; returns its exit code (the table of :mod:`deck.cli`)."""
    from deck.merge.launch import resolve_worker

    if a.gc is False:
        _retention(a)  # the retention flags are validated even when --gc does not use them
    _merge_config(a, 0, 1)  # validate the options before starting (or saying) anything
    gc_schedule(a.gc_every, a.gc_whole_every)
    if not a.follow:
        # A catch-up on a URI that is not there is a typo; a --follow worker may start before
        # the trainer has written anything.
        storage = open_existing(a.uri, a.storage_options)
    # Flags, else torchrun / Kubernetes Indexed Job / SLURM variables (deck.merge.launch).
    k = a.workers
    slot = resolve_worker(
        a.worker_index, a.num_workers, names=("--worker-index", "--num-workers"), announce=k == 1
    )
    if not a.follow:
        from deck.ops.retention.gc import holds_a_store

        if not holds_a_store(storage):  # (a folder with nothing of deck's: a typo too)
            raise CheckpointNotFoundError(f"no checkpoints at {a.uri}: nothing to merge")
    first, hosts = slot.index, slot.count
    if k < 1:
        raise ConfigError(f"--workers must be >= 1, got {k}")
    indices = [first * k + j for j in range(k)]
    total = hosts * k
    if k > 1:  # which workers this process runs (its slot times --workers)
        logging.getLogger("deck.merge.launch").info(
            "deck merge: workers %d..%d of %d (--workers %d; this process is %d of %d, from %s)",
            indices[0],
            indices[-1],
            total,
            k,
            slot.index,
            slot.count,
            slot.source,
        )
    if a.follow and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # (its workers ignore it too: a soak's driver waited a minute for a stop by Ctrl-C)
        logger.warning(
            "deck merge: SIGINT is ignored (started ignoring it: a shell's background job?); "
            "stop it with SIGTERM"
        )
    t0 = time.perf_counter()
    tally = _MergeTally()
    if k == 1:
        code = _run_worker(a, indices[0], total, lambda kind, _stats: tally.event(kind))
    else:
        code = _run_workers(a, indices, total, tally)
    tally.close()
    who = f"worker {indices[0]}" if k == 1 else f"workers {indices[0]}..{indices[-1]}"
    print(
        f"deck merge: {tally.committed} checkpoint(s) committed by {who} of {total}, "
        f"{tally.partitions} partition(s) built, in {time.perf_counter() - t0:.1f} s"
        + ("; some work is left (see the warnings above)" if code == 1 else "")
    )
    return code


class _MergeTally:
    """What the merger workers of ``deck merge`` did so far, from their progress events:
    partitions built, checkpoints committed (also a progress bar, on a terminal)."""

    def __init__(self) -> None:
        self.committed = 0
        self.partitions = 0
        self.bar = progress_bar("deck merge", unit=" ckpt", unit_scale=False)

    def event(self, kind: str) -> None:
        if kind == "partition":
            self.partitions += 1
        elif kind == "commit":
            self.committed += 1
            if self.bar:
                self.bar.update(1)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def _run_workers(a: argparse.Namespace, indices: list[int], total: int, tally: _MergeTally) -> int:
    """Merger workers ``indices`` (of ``total``), one process each, until all have exited;
    returns the exit code (:meth:`_Workers.code`)."""
    ctx = multiprocessing.get_context("spawn")
    parent = os.getpid()

    def start(i: int) -> tuple[Any, Any]:
        # A pipe of its own per worker, not one queue for all: a worker killed while it wrote
        # to a shared queue left its lock held, and every other worker then hung at its exit
        # flushing what it had put (and the command with it, at a stop)
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(a, i, total, writer, parent))
        p.start()
        writer.close()  # (the worker's end: the reader sees EOF once the worker is gone)
        return p, reader

    def on_term(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # (SIGTERM: kill, systemd, Kubernetes) stop the workers too

    # Spawning starts multiprocessing's resource tracker at the first start, and starting it
    # unblocks SIGINT / SIGTERM (Python's own code): a stop then landed inside a worker's
    # start (exit 2 or 130, no word). Started here, before any stop is taken.
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.signal(signal.SIGTERM, on_term)
    workers = _Workers(start, a.follow)
    try:
        try:
            for i in indices:
                workers.launch(i)
            workers.collect(tally)
        except KeyboardInterrupt:
            # Each worker stops (a --follow one after its pass, saying how it ended)
            workers.stop()
            workers.collect(tally)
    finally:
        signal.signal(signal.SIGTERM, previous)
        workers.join()
    return workers.code()


class _Workers:
    """The worker processes of one ``deck merge --workers K``, by index, and how each ended.

    With --follow, a worker that dies without saying how (killed, crashed) is started again
    after a pause that doubles from 1 s to 60 s (back to 1 s once it had run 10 minutes), said
    at WARNING: the other workers wait for its partitions, so merging would stop (a break-it
    finding: one worker killed with -9 stopped all merging, said at INFO only, while the
    command ran on). One that gives up saying why (exit status 2) stops them all: they would
    wait for it for ever. A stop of the command is exit 0 whatever died before it (said)."""

    def __init__(self, start: Callable[[int], tuple[Any, Any]], follow: bool) -> None:
        self._start = start
        self.follow = follow
        self.procs: dict[int, Any] = {}
        self._events: dict[int, Any] = {}  # index -> the reading end of its pipe, until EOF
        self.codes: dict[int, int] = {}
        self._started: dict[int, float] = {}
        self._pause: dict[int, float] = {}
        self._restart_at: dict[int, float] = {}
        self._ended: set[int] = set()  # pids of workers already started again
        self.stopping = False

    def launch(self, i: int) -> None:
        # Blocked while it starts (the child unblocks them once it can stop cleanly), and until
        # it is known here: a stop arriving meanwhile reaches it (SIGTERM raises
        # KeyboardInterrupt here; one raised before this assignment left it running unknown)
        with stop_signals_blocked():
            self.procs[i], self._events[i] = self._start(i)
            self._started[i] = time.monotonic()

    def collect(self, tally: _MergeTally) -> None:
        """Pass the workers' events to ``tally`` and record each one's exit code as it comes
        (an interrupt keeps what has come), until every worker has one."""
        while len(self.codes) < len(self.procs):
            self._restart_due()
            ready = multiprocessing.connection.wait(list(self._events.values()), timeout=0.5)
            for i, conn in list(self._events.items()):
                if conn in ready:
                    self._read(i, conn, tally)
            self._check_dead()  # (workers that died without a word)

    def _read(self, i: int, conn: Any, tally: _MergeTally) -> None:
        try:
            kind, x, y = json.loads(conn.recv_bytes())
        except (EOFError, OSError, ValueError) as e:  # gone (a message cut short by a kill)
            if not isinstance(e, EOFError):
                logger.debug("deck merge: reading worker %d's events: %r", i, e)
            conn.close()
            del self._events[i]
            return
        if kind != "exit":
            tally.event(kind)
            return
        if self.follow and not self.stopping:
            if y not in (0, 130):
                self.codes[x] = y
                logger.warning("deck merge: worker %d gave up (above): stopping the others", x)
                self.stop()
            else:  # (a stop sent to that worker alone: the others would wait for it)
                self._again(x, "was stopped alone")
            return
        self.codes[x] = y

    def _again(self, i: int, how: str) -> None:
        """Start worker ``i`` again after its pause (it ended while the others follow)."""
        self._ended.add(self.procs[i].pid)
        lived = time.monotonic() - self._started[i]
        pause = 1.0 if lived >= 600 else min(self._pause.get(i, 0.5) * 2, 60.0)
        self._pause[i] = pause
        self._restart_at[i] = time.monotonic() + pause
        logger.warning(
            "deck merge: worker %d %s; starting it again in %.0f s (a worker may be killed at "
            "any point: what it left is finished or cleaned up)",
            i,
            how,
            pause,
        )

    def _check_dead(self) -> None:
        for i, p in self.procs.items():
            if i in self.codes or p.pid in self._ended or i in self._events or p.is_alive():
                continue
            # (its pipe is read to its end, and it held no last words)
            how = (
                f"was killed by {signal.Signals(-p.exitcode).name}"
                if p.exitcode < 0
                else f"exited with status {p.exitcode}"
            )
            if self.stopping and p.exitcode == -signal.SIGTERM:
                self.codes[i] = 130  # (stopped before it could say so)
            elif self.follow and not self.stopping:
                self._again(i, f"{how} without a word")
            elif self.follow:  # (a service told to stop: what it left is finished next time)
                self.codes[i] = 0
                logger.warning("deck merge: worker %d %s without a word (stopping)", i, how)
            else:
                self.codes[i] = 2
                print(f"deck merge: worker {i} {how} without finishing", file=sys.stderr)

    def _restart_due(self) -> None:
        now = time.monotonic()
        for i, at in list(self._restart_at.items()):
            if now >= at:
                del self._restart_at[i]
                self.launch(i)

    def stop(self) -> None:
        """Stop every worker (a --follow one after its pass; one waiting to start again is not:
        a stop of the service at any moment is exit 0, a break-it finding)."""
        self.stopping = True
        for i in list(self._restart_at):
            del self._restart_at[i]
            self.codes[i] = 0
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()

    def join(self) -> None:
        for p in self.procs.values():
            if p.pid is not None:
                p.join()

    def code(self) -> int:
        """The worst a worker gave: 2 before 1 before 130 (interrupted) before 0."""
        codes = list(self.codes.values()) or [2]
        worse = [c for c in codes if c not in (0, 130)]
        return max(worse) if worse else (130 if 130 in codes else 0)


def cmd_gc(a: argparse.Namespace) -> int:
    """Run ``deck gc`` with parsed arguments ``a``; returns its exit code (the table of :mod:`deck.cli`)."""
    from deck.ops.retention import collect_garbage

    storage = open_existing(a.uri, a.storage_options)
    reached: list[str] = []  # the checkpoints the run deleted or retired so far
    bar = progress_bar("deck gc", unit=" ckpt", unit_scale=False)

    def progress(folder: str) -> None:
        reached.append(folder)
        if bar:
            bar.update(1)
        elif not a.dry_run:
            # (a cron job's log of a run killed or timed out says what it was deleting: the
            # report comes only at the end; a break-it finding found such logs empty)
            print(f"deck gc: deleting {folder}", file=sys.stderr, flush=True)

    try:
        rep = collect_garbage(
            storage, _retention(a), dry_run=a.dry_run, whole=a.whole, progress=progress
        )
    except KeyboardInterrupt:
        where = (
            f"at {reached[-1]} (checkpoint {len(reached)} it deleted or retired)"
            if reached
            else "before it deleted a checkpoint"
        )
        # (said by the one line every interrupted command prints: a break-it finding saw two)
        raise KeyboardInterrupt(
            f"interrupted {where}: every step it retains still restores; run it again to finish"
        ) from None
    finally:
        if bar:
            bar.close()
    verb = "would delete" if a.dry_run else "deleted"
    if (
        rep.latest is None
        and rep.floor is None
        and not (rep.deleted or rep.orphans or rep.kept or rep.busy or rep.errors)
    ):
        if rep.committed:
            print(
                f"{rep.committed} committed checkpoint(s) at {a.uri} but none restorable (a "
                "chain lacks a checkpoint or passes through a quarantined one: `deck verify "
                f"{a.uri} --all` says which); nothing deleted",
                file=sys.stderr,
            )
            return 1
        raise CheckpointNotFoundError(f"no checkpoints at {a.uri}: nothing to collect")
    if rep.latest is None and rep.floor is not None:
        print(f"every checkpoint of step {rep.floor} and later is in the grace period")
    elif rep.latest is None:
        print(f"no restorable checkpoint at {a.uri}: nothing deleted but orphans")
    else:
        steps = rep.retained_steps
        shown = ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "")
        since = f" from step {rep.floor} on" if rep.floor is not None else ""
        print(f"latest step {rep.latest}; {len(steps)} step(s){since} stay restorable: {shown}")
    if rep.floor is not None:
        print(
            f"looked at the folders of steps {rep.floor} and later (older ones: "
            f"`deck gc {a.uri} --whole`)"
        )
    for folder, why in rep.deleted:
        print(f"  {verb} {folder}: {why}")
    for folder, why in rep.retired:
        print(f"  {'would retire' if a.dry_run else 'retired'} {folder}: {why}")
    for prefix, why in rep.orphans:
        print(f"  {_orphan_line(verb, prefix, why)}")
    for folder, why in rep.left:
        print(f"  left {folder}: {why}")
    for folder, why in rep.kept:
        print(f"  KEPT {folder}: {why}")
    for folder, why in rep.busy:
        print(f"  kept {folder}: {why}")
    for e in rep.errors:
        print(f"  ERROR {e}", file=sys.stderr)
    if rep.clock_skew_s is not None and abs(rep.clock_skew_s) > 60:
        print(
            f"this host's clock is {rep.clock_skew_s:+.0f} s from the store's; ages were "
            "measured on the store's clock"
        )
    retired = f"; {'would retire' if a.dry_run else 'retired'} {len(rep.retired)}" * bool(
        rep.retired
    )
    print(
        f"{verb} {len(rep.deleted)} checkpoint(s) and {len(rep.orphans)} orphan(s): "
        f"{rep.files} files, {human(rep.bytes)}{retired}"
        + (
            f"; kept {len(rep.kept)} because of damage or read errors (KEPT above)"
            if rep.kept
            else ""
        )
        + (
            f"; kept {len(rep.busy)} that writers were at work on (the next run decides)"
            if rep.busy
            else ""
        )
    )
    if a.dry_run:
        print(
            "not counted by a dry run: temp files of interrupted writes and empty folders (the "
            "real run removes those older than the grace period)"
        )
    if rep.retire_wait_s is not None:
        print(
            "a run retired merger checkpoints less than the grace period ago: no checkpoint is "
            f"deleted or retired for another {rep.retire_wait_s:.0f} s"
        )
    if rep.grace_held or rep.grace_held_orphans:
        print(
            f"held back by the grace period (--grace {a.grace:g} s): {rep.grace_held} "
            f"checkpoint(s), {rep.grace_held_orphans} orphan(s); a later run deletes them "
            "(--grace 0 when nothing runs on this URI)"
        )
    return 1 if rep.errors or rep.kept else 0  # damage kept things: someone must look


def _orphan_line(verb: str, prefix: str, why: str) -> str:
    """One orphan of a GC report, saying what goes: stray files inside a committed folder (GC
    reports them as ``folder/ (N file(s))``; the checkpoint itself stays), or a whole folder."""
    stray = re.fullmatch(r"(.*/) \((\d+) file\(s\)\)", prefix)
    if stray:
        folder, n = stray.groups()
        return f"{verb} {n} stray file(s) inside {folder} ({why}); the checkpoint itself stays"
    return f"{verb} {prefix}: {why}"


def _add_retention_args(p: argparse.ArgumentParser) -> None:
    """The retention flags of ``deck gc`` and ``deck merge --gc``; their defaults are
    :class:`RetentionPolicy`'s (see :func:`_retention` for the mapping back)."""
    from deck.ops.retention import RetentionPolicy

    default = {name: f.default for name, f in RetentionPolicy.model_fields.items()}
    p.add_argument(
        "--keep-last-fulls",
        type=int,
        default=default["keep_last_fulls"],
        help=f"newest fulls kept for rollback ({default['keep_last_fulls']})",
    )
    p.add_argument(
        "--keep-fulls-every",
        type=int,
        default=default["keep_fulls_every"],
        metavar="N",
        help="also keep the oldest full of every N-step period (rollback past bad data)",
    )
    p.add_argument(
        "--keep-all-steps",
        action=argparse.BooleanOptionalAction,
        default=default["keep_all_steps"],
        help="keep every currently restorable step restorable (default); --no-keep-all-steps: "
        "only the active window and the rollback fulls (DECK fig. 9)",
    )
    p.add_argument(
        "--keep-merged-deltas",
        action=argparse.BooleanOptionalAction,
        default=default["keep_merged_deltas"],
        help="keep the merged deltas a retained step's cheapest chain reads (default); "
        "--no-keep-merged-deltas: old steps restore through the trainer's deltas (less storage)",
    )
    p.add_argument(
        "--chain-delta-budget",
        type=budget,
        default=default["chain_delta_budget"],
        metavar="F",
        help="with every step kept: keep a full wherever the deltas since the last kept one add "
        f"up to F fulls' bytes, bounding old steps' restores ({default['chain_delta_budget']:g}; "
        "0: off)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=default["grace_s"],
        metavar="S",
        help="never delete what the lineage needed S seconds ago, nor files younger "
        f"({default['grace_s']:g})",
    )
    p.add_argument(
        "--max-clock-skew",
        type=float,
        default=default["max_clock_skew_s"],
        metavar="S",
        help="ages are measured on the store's clock; refuse to delete anything when this "
        f"host's clock is further than S seconds from the store's ({default['max_clock_skew_s']:g}"
        "; -1: no bound)",
    )
    p.add_argument(
        "--verify-replacements",
        action=argparse.BooleanOptionalAction,
        default=default["verify_replacements"],
        help="check every checksum of a kept merger checkpoint before deleting what it "
        "replaces, reading it once (the default); --no-verify-replacements: only that its "
        "files exist with their sizes",
    )
    p.add_argument(
        "--drop-quarantined",
        action="store_true",
        help="delete quarantined checkpoints and the steps that restore only through them "
        "(default: they stay, reported as kept, until repaired)",
    )


def _add_merge_config_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``deck merge`` that make its :class:`MergeConfig` / :class:`FullPolicy`;
    their defaults are the models' (see :func:`_merge_config` for the mapping back)."""
    from deck.merge.policy import FullPolicy, MergeConfig

    merge = {name: f.default for name, f in MergeConfig.model_fields.items()}
    full = {name: f.default for name, f in FullPolicy.model_fields.items()}
    p.add_argument(
        "--stride",
        type=int,
        default=merge["stride"],
        help=f"items per merge, s ({merge['stride']})",
    )
    p.add_argument(
        "--full-every",
        type=int,
        default=full["every"],
        metavar="N",
        help=f"new full every N deltas ({full['every'] or 'off'}; 0: off)",
    )
    p.add_argument(
        "--full-live-fraction",
        type=float,
        default=full["max_live_fraction"] or 0.0,
        metavar="F",
        help="new full when a restore reads more than F x a full on top of it "
        f"({full['max_live_fraction'] or 0.0}; 0: off)",
    )
    p.add_argument(
        "--full-cost-ratio",
        type=float,
        default=full["cost_ratio"],
        metavar="R",
        help="IncrCP-style rule: new full when live x R >= 2 x full + live",
    )
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=merge["chunk_bytes"],
        help="chunk size of merged files",
    )


def merge_parser(sub: Subparsers) -> None:
    """Add the ``deck merge`` subcommand (its flags and handler) to ``sub``."""
    mer = sub.add_parser("merge", help="run merger worker(s): merged deltas and new fulls")
    mer.add_argument("uri")
    mode = mer.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="catch up and exit (default)")
    mode.add_argument("--follow", action="store_true", help="keep merging until interrupted")
    _add_merge_config_args(mer)
    mer.add_argument("--workers", type=int, default=1, help="worker processes to run here (1)")
    mer.add_argument(
        "--worker-index",
        type=int,
        default=None,
        help="this host's index (default: $RANK, $JOB_COMPLETION_INDEX or $SLURM_PROCID)",
    )
    mer.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="hosts running workers (default: $WORLD_SIZE, $DECK_NUM_WORKERS or $SLURM_NTASKS)",
    )
    mer.add_argument("--gc", action="store_true", help="worker 0 also runs GC after each pass")
    mer.add_argument(
        "--gc-every",
        type=int,
        default=1,
        help="--gc: run GC after every N-th pass (1; on an object store each run costs requests)",
    )
    mer.add_argument(
        "--gc-whole-every",
        type=int,
        default=100,
        help="--gc: the first run and every N-th look at the whole store; the others at the "
        "newest steps (100)",
    )
    mer.add_argument(
        "--poll", type=poll_seconds, default=5.0, help="--follow: seconds between scans"
    )
    mer.add_argument(
        "--wait",
        type=seconds,
        default=60.0,
        help="--once: seconds to wait for other workers' partitions (60)",
    )
    _add_retention_args(mer)
    mer.set_defaults(fn=cmd_merge)


def gc_parser(sub: Subparsers) -> None:
    """Add the ``deck gc`` subcommand (its flags and handler) to ``sub``."""
    gc = sub.add_parser("gc", help="delete what no retained step needs (retention)")
    gc.add_argument("uri")
    gc.add_argument("--dry-run", action="store_true", help="only report what would go")
    gc.add_argument(
        "--whole",
        action="store_true",
        help="list the whole store and read every commit record (default: where the catalog "
        "allows, only the folders of the newest steps)",
    )
    _add_retention_args(gc)
    gc.set_defaults(fn=cmd_gc)
