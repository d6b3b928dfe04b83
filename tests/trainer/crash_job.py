"""Crash-consistency driver: SIGKILL a real 2-rank DMP trainer, merger workers and GC at named
failpoints (deck.failpoints), restart, and check what survived.

    python tests/trainer/crash_job.py ROOT [threads|process [staging|all]]   # ROOT/results.json

The second argument is ``StagingConfig.mode`` (default ``threads``). With ``process`` the points
of :data:`STAGING_POINTS` are hit in each rank's staging process, whose ``kill`` kills its
training process first (the rank dies there, as with threads): the driver checks from the
marker that each kill came from the process it should (the staging process exactly for
:data:`STAGING_POINTS`). The third argument picks the plan: ``all`` (default) every point below;
``staging`` (what CI runs in process mode) one (point, nth) per point the staging process
passes, in the plan's order, the recovery points with the kills they follow, and no merger or
GC kills (those never stage).

One driver process imports torch, TorchRec and deck once and forks every incarnation from
itself, so a restart costs a process group and a model, not a Python start (a 2-rank job start
is seconds on 2 cores). Each trainer incarnation is a restart of the one before:

1. arm one failpoint (``DECK_FAILPOINTS``) in one rank;
2. construct the checkpointer on the same URI and spool (lease takeover, spool recovery), then
   ``restore()`` and compare the state bitwise with what the trainer had live at that step
   (reference files the ranks wrote before each ``ck.step``: ``torch`` tensors through
   safetensors, never pickle);
3. train and checkpoint every step until the failpoint kills the rank; the driver then kills the
   other rank at once (a job scheduler does the same when one rank dies).

After each kill the driver records what is committed and what is pending in the spool; after the
next restart it checks that no committed step was lost, that every part pending on every rank
was committed (a checkpoint reported staged is never lost), and that the restored step is the
newest committed one. Merger and GC processes are killed the same way, then rerun unarmed;
finally every retained step restores bitwise, ``deck verify --all`` passes and GC leaves no
temp files. Assertion failures inside ranks end the run with their log.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import deck
from deck import failpoints
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.format.manifest import load_model
from deck.merge.policy import FullPolicy, MergeConfig
from deck.merge.worker import MergeWorker
from deck.ops.retention import RetentionPolicy, collect_garbage, plan_retention
from deck.processes import init_process_group, rendezvous
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.read.verify import verify_checkpoint
from deck.storage import LocalStorage
from deck.trainer.staging import PENDING_SUFFIX, PendingPart

SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")
STEPS_PER_RUN = 4  # an incarnation whose point is never hit ends after this many checkpoints
RANKS = 2

# (point, nth, rank) for trainer incarnations, in order. nth counts hits in that process.
# Per-file points (chunks, spool writes, uploads) hit several times per checkpoint; per-part
# points once per checkpoint, so nth picks the 1st/2nd/3rd checkpoint of the incarnation (full
# or delta). "stager.recover.before_check" kills a restart while it finishes the parts the kill
# before left in the spool: it follows a kill at "stager.fsync.before" of the same rank, which
# always leaves one (every rank wrote its pending record before the all-gather that precedes
# the fsync: FIRST_TIER_POINTS below; and the killed rank's part is not uploaded), whatever the
# other rank was doing.
TRAINER_POINTS: list[tuple[str, int, int]] = [
    ("writer.chunk.before_fill", 1, 0),
    ("writer.chunk.before_fill", 3, 1),
    ("writer.chunk.before_fill", 7, 0),
    ("writer.chunk.after_submit", 1, 1),
    ("writer.chunk.after_submit", 3, 0),
    ("writer.part.before_state_files", 1, 0),
    ("writer.part.before_state_files", 2, 1),
    ("writer.part.before_manifest", 1, 1),
    ("writer.part.before_manifest", 3, 0),
    ("stager.spool.before_write", 2, 0),
    ("stager.spool.before_write", 6, 1),
    ("stager.spool.write", 1, 1),
    ("stager.spool.write", 4, 0),
    ("stager.spool.after_write", 3, 0),
    ("stager.spool.after_write", 8, 1),
    ("stager.pending.before_write", 1, 1),
    ("stager.pending.before_write", 2, 0),
    ("stager.pending.write", 1, 0),
    ("stager.pending.before_rename", 2, 1),
    ("stager.pending.after_write", 1, 0),
    ("stager.pending.after_write", 3, 1),
    ("checkpointer.save.staged", 1, 1),
    ("checkpointer.save.staged", 2, 0),
    ("checkpointer.save.enqueued", 1, 0),
    ("checkpointer.save.enqueued", 3, 1),
    ("stager.fsync.before", 1, 1),
    ("stager.recover.before_check", 1, 1),
    ("stager.fsync.before", 2, 0),
    ("stager.recover.before_check", 1, 0),
    ("stager.fsync.after", 2, 1),
    ("stager.upload.before_put", 1, 0),
    ("stager.upload.before_put", 5, 1),
    ("stager.upload.after_put", 2, 1),
    ("stager.upload.after_put", 7, 0),
    ("stager.part_manifest.before_put", 1, 1),
    ("stager.part_manifest.before_put", 2, 0),
    ("stager.part_manifest.after_put", 1, 0),
    ("stager.part_manifest.after_put", 3, 1),
    ("stager.commit.before", 1, 0),
    ("stager.commit.before", 2, 0),
    ("commit.before_manifest", 1, 0),
    ("commit.before_manifest", 3, 0),
    ("commit.after_witness", 2, 0),
    ("commit.after_hint", 2, 0),
    ("commit.after_manifest", 1, 0),
    ("commit.after_manifest", 2, 0),
    ("stager.cleanup.before", 1, 1),
    ("stager.cleanup.before", 2, 0),
    ("stager.cleanup.after_files", 1, 0),
    ("lease.acquire.before_put", 1, 0),
    ("lease.acquire.after_put", 1, 0),
]
# The points a staging process (StagingConfig(mode="process")) passes; the rest of the trainer's
# are hit in the training process in both modes. tests/trainer/test_staging_process.py checks
# this list against what a staging process reports it reached (ProcessStager.failpoint_hits).
STAGING_POINTS = frozenset(
    {
        "stager.spool.before_write",
        "stager.spool.write",
        "stager.spool.after_write",
        "stager.pending.before_write",
        "stager.pending.write",
        "stager.pending.before_rename",
        "stager.pending.after_write",
        "stager.fsync.before",
        "stager.fsync.after",
        "stager.recover.before_check",
        "stager.upload.before_put",
        "stager.upload.after_put",
        "stager.part_manifest.before_put",
        "stager.part_manifest.after_put",
        "stager.commit.before",
        "commit.before_manifest",
        "commit.after_witness",
        "commit.after_hint",
        "commit.after_manifest",
        "stager.cleanup.before",
        "stager.cleanup.after_files",
    }
)
# Test hooks a staging process passes too, armed with "enospc" by other tests (a spool fsync
# that fails, a full local disk): no kill of this run arms them, the staging process's
# kill-self test does.
STAGING_HOOKS = frozenset({"stager.spool.fsync", "storage.local.write"})
MODE = "threads"  # StagingConfig.mode of every incarnation (main's second argument)
PLAN = "all"  # which incarnations (main's third argument)
# New fulls: incarnations that take every checkpoint as a full (a trainer full after restore).
FULL_POINTS: list[tuple[str, int, int]] = [
    ("writer.chunk.before_fill", 2, 1),
    ("writer.chunk.after_submit", 9, 0),
    ("stager.spool.after_write", 5, 1),
    ("stager.upload.after_put", 4, 0),
    ("stager.part_manifest.after_put", 2, 1),
    ("commit.before_manifest", 2, 0),
    ("commit.after_manifest", 3, 0),
]
# (point, nth) for `deck merge --once` workers (one process), then for GC.
MERGER_POINTS: list[tuple[str, int]] = [
    ("merger.partition.before_read", 1),
    ("merger.partition.after_read", 2),
    ("merger.chunk.after_put", 1),
    ("merger.chunk.after_put", 4),
    ("merger.partition.after_chunks", 3),
    ("merger.partition.after_record", 1),
    ("merger.partition.after_record", 4),
    ("merger.commit.before_rank_manifests", 1),
    ("merger.commit.before_manifest", 1),
    ("merger.commit.after_manifest", 1),
    ("merger.commit.before_manifest", 2),
    ("merger.commit.after_manifest", 3),
]
GC_POINTS: list[tuple[str, int]] = [
    ("gc.checkpoint.before_delete", 1),
    ("gc.checkpoint.after_uncommit", 1),
    ("gc.checkpoint.after_delete", 2),
    ("gc.checkpoint.after_uncommit", 4),
    ("gc.orphan.before_delete", 1),
    ("gc.orphan.after_delete_file", 2),
]
# Points hit only on a trainer's training thread inside ck.step (never by a restart's recovery,
# which runs in the background while restore() does): an incarnation armed with one restores
# first, always, so its restart is checked. Other points may kill an incarnation before its
# restore (lease, recovery of what the previous kill left), depending on thread timing.
AFTER_RESTORE = ("writer.", "checkpointer.save.", "stager.spool.", "stager.pending.")


def restarts_always_checked(plan: str = "all") -> int:
    """How many restarts :func:`drive` checks however threads interleave: the incarnations armed
    with an :data:`AFTER_RESTORE` point, the clean restart after the trainer kills and (plan
    "all") the last one. (A staging process passes the spool and pending points only for parts
    staged after the restore too: recovery writes neither.)"""
    armed = sum(p.startswith(AFTER_RESTORE) for p, _, _, _ in plan_for(plan))
    return armed + (2 if plan == "all" else 1)


MERGE = MergeConfig(stride=2, full=FullPolicy(every=6, max_live_fraction=None), chunk_bytes=4096)
KEEP = RetentionPolicy(keep_last_fulls=2, keep_all_steps=False, grace_s=0)


@dataclass
class Paths:
    root: str

    @property
    def uri(self) -> str:
        return os.path.join(self.root, "ck")

    @property
    def spool(self) -> str:
        return os.path.join(self.root, "spool")

    @property
    def refs(self) -> str:
        return os.path.join(self.root, "refs")

    @property
    def logs(self) -> str:
        return os.path.join(self.root, "logs")

    def ref(self, step: int, rank: int) -> str:
        return os.path.join(self.refs, f"state-{step:06d}-r{rank}.safetensors")


# Incarnations armed at these points run with release="first_tier": every rank's pending record
# is then written before the all-gather that precedes the kill, so the kill always leaves a part
# pending on every rank for the next incarnation's recovery point to fire on. The rest run with
# the default "in_memory" (training released before the spool writes).
FIRST_TIER_POINTS = ("stager.fsync.before",)


def release_for(spec: str | None) -> str:
    return "first_tier" if spec and spec.startswith(FIRST_TIER_POINTS) else "in_memory"


def config(p: Paths, release: str = "in_memory") -> deck.DeckConfig:
    return deck.DeckConfig(
        uri=p.uri,
        delta_every_steps=1,
        lease_ttl_s=60,
        staging=deck.StagingConfig(
            chunk_bytes=4096,
            chunks_in_flight=2,
            tiers="cpu-ssd-remote",
            spool_dir=p.spool,
            upload_concurrency=2,
            retry_initial_s=0.05,
            retry_max_s=0.2,
            commit_timeout_s=60,
            release=release,
            mode=MODE,  # type: ignore[arg-type]
        ),
    )


# ---- inside a forked rank ----------------------------------------------------------------------


def _child_setup(p: Paths, name: str, spec: str | None) -> None:
    """Own log file, one compute thread, this process's failpoint (if any)."""
    fd = os.open(os.path.join(p.logs, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ[failpoints.MARKER_ENV] = os.path.join(p.root, "killed")
    failpoints.configure(spec)


def _save_ref(p: Paths, step: int, rank: int, state: dict[str, torch.Tensor]) -> None:
    """The live state at ``step``; training is deterministic, so a step trained again after a
    restore must give the same bits (checked: a mismatch would void every later comparison)."""
    path = p.ref(step, rank)
    if os.path.exists(path):
        bad = diff_states(load_file(path), state)
        assert not bad, f"rank {rank}: step {step} trained again differs: {bad[:5]}"
        return
    save_file(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def _trainer(
    rank: int, where: str, p: Paths, spec: str | None, inc: int, mode: str, release: str
) -> None:
    """One rank of one incarnation; ``mode``: train (deltas), full (every checkpoint a full),
    verify-all (restore each step of $CRASH_VERIFY_STEPS, compare, no training); ``release``:
    the incarnation's StagingConfig.release (the same on every rank)."""
    _child_setup(p, f"inc{inc:03d}-r{rank}", spec)
    t0 = time.perf_counter()

    def log(what: str) -> None:
        print(f"{time.perf_counter() - t0:7.3f} s  {what}", flush=True)

    log(f"incarnation {inc} rank {rank}: failpoint {spec}")
    init_process_group(rank, RANKS, where)
    model, opt = build_model(SPEC)
    log("model built")
    user = TrainState()
    ck = deck.DeltaCheckpointer(model, [opt], config(p, release), state=user)
    log(f"checkpointer ready, recovering {[s.step for s in ck.recovered]}")
    out: dict[str, Any] = {"recovered": sorted(s.step for s in ck.recovered)}
    if mode == "verify-all":
        steps = json.loads(os.environ["CRASH_VERIFY_STEPS"])
        for step in steps:
            assert ck.restore(step) == step
            bad = diff_states(load_file(p.ref(step, rank)), capture_state(model, opt, user))
            assert not bad, f"rank {rank} step {step}: {bad[:5]}"
        out["verified"] = steps
    else:
        start = ck.restore()
        out["restored"] = start
        if start is not None:
            bad = diff_states(load_file(p.ref(start, rank)), capture_state(model, opt, user))
            assert not bad, f"rank {rank}: restored step {start} differs: {bad[:5]}"
        with open(os.path.join(p.root, f"inc{inc:03d}-r{rank}-restored.json"), "w") as f:
            json.dump(out, f)
        log(f"restored {start}")
        first = 0 if start is None else start + 1
        for step in range(first, first + STEPS_PER_RUN):
            if step:
                user.losses.append(train_step(model, opt, SPEC, step))
                user.step = step
            _save_ref(p, step, rank, capture_state(model, opt, user))
            if mode == "full":
                ck.save("full", step=step)
            else:
                ck.step(step)
            log(f"step {step} staged")
    assert ck.flush(timeout=120)
    log("flushed")
    out["states"] = {h.step: h.state for h in ck.history}
    ck.close()
    dist.barrier()
    log("closed")
    with open(os.path.join(p.root, f"inc{inc:03d}-r{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _trainer_entry(*args: Any) -> None:
    try:
        _trainer(*args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)  # no cleanup: the driver treats any rank failure as the job's failure
    os._exit(0)


def _tool_entry(p: Paths, name: str, spec: str | None, what: str, uri: str) -> None:
    try:
        _child_setup(p, name, spec)
        storage = LocalStorage(uri)
        if what == "merge":
            _, left = MergeWorker(storage, MERGE).run_once(wait_s=0)
            assert left == 0, f"{left} merge item(s) left"
        else:
            rep = collect_garbage(storage, KEEP)
            assert not rep.errors, rep.errors
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)
    os._exit(0)


# ---- the driver ---------------------------------------------------------------------------------


@dataclass
class Results:
    kills: list[str] = field(default_factory=list)  # "<process>:<point>:<nth>" that fired
    staging_kills: list[str] = field(default_factory=list)  # of those, hit in a staging process
    mode: str = "threads"
    not_reached: list[str] = field(default_factory=list)
    restarts_checked: int = 0
    recovered_parts: int = 0
    seconds: float = 0.0


class Failure(Exception):
    pass


def _log_tail(p: Paths, prefix: str) -> str:
    out = []
    for name in sorted(os.listdir(p.logs)):
        if name.startswith(prefix):
            with open(os.path.join(p.logs, name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-3000:]}")
    return "\n".join(out)


def _run_procs(procs: list[Any], timeout: float) -> list[int]:
    """Start ``procs``; when one dies abnormally, SIGKILL the rest at once. Exit codes."""
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive:
        ready = wait([pr.sentinel for pr in alive], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            for pr in alive:
                os.kill(pr.pid, signal.SIGKILL)
            for pr in procs:
                pr.join()
            raise Failure(f"processes did not finish in {timeout:.0f} s")
        for pr in [x for x in alive if x.sentinel in ready]:
            pr.join()
            alive.remove(pr)
            if pr.exitcode != 0:
                for other in alive:
                    os.kill(other.pid, signal.SIGKILL)
    for pr in procs:
        pr.join()
    return [pr.exitcode for pr in procs]


def _killed(p: Paths) -> str | None:
    path = os.path.join(p.root, "killed")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    os.remove(path)
    return text


def _committed(p: Paths) -> dict[int, str]:
    return {s: m.id for s, m in read_manifests(LocalStorage(p.uri)).items()}


def _pending(p: Paths) -> dict[tuple[int, str], PendingPart]:
    """Parts pending on every rank (and their records) in the shared spool."""
    per: dict[tuple[int, str], list[PendingPart]] = {}
    for dirpath, _, files in os.walk(p.spool):
        for f in files:
            if f.endswith(PENDING_SUFFIX):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    rec = load_model(PendingPart, fh.read(), f)
                per.setdefault((rec.step, rec.ckpt_id), []).append(rec)
    return {k: v[0] for k, v in per.items() if len(v) == RANKS}


def _must_commit(
    committed: dict[int, str], pending: dict[tuple[int, str], PendingPart]
) -> set[tuple[int, str]]:
    """Pending-on-every-rank parts whose chain can complete: a restart must commit them."""
    out: set[tuple[int, str]] = set()
    for key, rec in sorted(pending.items()):
        if rec.kind.value == "full" or (
            rec.parent is not None
            and (committed.get(rec.parent) == rec.parent_id or (rec.parent, rec.parent_id) in out)
        ):
            out.add(key)
    return out


def _trainer_run(p: Paths, inc: int, spec: str | None, armed: int, mode: str = "train") -> str:
    ctx = mp.get_context("fork")
    where = rendezvous(p.root)  # in the run's folder: a killed incarnation leaves its file there
    procs = [
        ctx.Process(
            target=_trainer_entry,
            args=(r, where, p, spec if r == armed else None, inc, mode, release_for(spec)),
        )
        for r in range(RANKS)
    ]
    codes = _run_procs(procs, timeout=240)
    fired = _killed(p)
    if fired is None and any(codes):
        raise Failure(
            f"incarnation {inc} ({spec}) failed: {codes}\n{_log_tail(p, f'inc{inc:03d}')}"
        )
    if fired is not None and codes[armed] != -signal.SIGKILL:
        raise Failure(f"incarnation {inc}: {fired} fired but rank {armed} exited {codes[armed]}")
    if fired is not None:
        # Where it fired: a staging process exactly for its points (process mode)
        where = fired.split()[1:]
        want = [failpoints.STAGING] if MODE == "process" and spec in _staging_specs() else []
        if where != want:
            raise Failure(f"incarnation {inc}: {spec} fired as {fired!r}; expected where {want}")
    return ("killed-staging" if fired.split()[1:] else "killed") if fired else "completed"


def _staging_specs() -> set[str | None]:
    return {f"{p}:{n}" for p, n, _ in TRAINER_POINTS + FULL_POINTS if p in STAGING_POINTS}


def plan_for(which: str) -> list[tuple[str, int, int, str]]:
    """The trainer incarnations of ``which`` ("all" or "staging": see the module docstring)."""
    plan = [(*x, "train") for x in TRAINER_POINTS] + [(*x, "full") for x in FULL_POINTS]
    if which == "all":
        return plan
    seen: set[str] = set()
    out = []
    for point, nth, rank, mode in plan:
        # Each recovery point with the kill it follows (both of them: one per rank)
        pair = point in ("stager.fsync.before", "stager.recover.before_check")
        if point in STAGING_POINTS and (pair or point not in seen):
            seen.add(point)
            out.append((point, nth, rank, mode))
    return out


def _check_restart(
    p: Paths, inc: int, before: dict[int, str], must: set[tuple[int, str]], res: Results
) -> set[tuple[int, str]]:
    """What the restart (incarnation ``inc``) must have preserved and recovered. Returns the
    obligations it could not be checked on (it died before restoring): the next restart's."""
    now = _committed(p)
    lost = {s: i for s, i in before.items() if now.get(s) != i}
    if lost:
        raise Failure(f"incarnation {inc}: committed steps lost or replaced: {lost}")
    path = os.path.join(p.root, f"inc{inc:03d}-r0-restored.json")
    if not os.path.exists(path):  # killed before its restore (lease, recovery): carry over
        return {k for k in must if now.get(k[0]) != k[1]}
    missing = {k for k in must if now.get(k[0]) != k[1]}
    if missing:
        raise Failure(f"incarnation {inc}: staged parts never committed: {sorted(missing)}")
    with open(path) as f:
        info = json.load(f)
    newest = max([*before, *(s for s, _ in must)], default=None)
    if newest is not None and (info["restored"] is None or info["restored"] < newest):
        raise Failure(f"incarnation {inc} restored {info['restored']}, newest committed {newest}")
    res.recovered_parts += len(info["recovered"])
    res.restarts_checked += 1
    return set()


def _tool_run(p: Paths, name: str, spec: str | None, what: str, uri: str | None = None) -> str:
    pr = mp.get_context("fork").Process(
        target=_tool_entry, args=(p, name, spec, what, uri or p.uri)
    )
    codes = _run_procs([pr], timeout=240)
    fired = _killed(p)
    if fired is None and codes[0] != 0:
        raise Failure(f"{name} ({spec}) failed: {codes}\n{_log_tail(p, name)}")
    return "killed" if fired else "completed"


def _merged_digest(uri: str) -> dict[str, list[Any]]:
    """Per merged checkpoint id: the checksums of its data (attempt folders are random names,
    the bytes are a function of the inputs)."""
    storage = LocalStorage(uri)
    out = {}
    for m in read_manifests(storage).merged.values():
        out[m.id] = [
            (
                part.rank,
                [(s.table, s.row_offset, [c.checksum for c in s.chunks]) for s in part.shards],
                part.dense.checksum if part.dense else None,
                part.extra.checksum,
            )
            for part in read_rank_manifests(storage, m)
        ]
    return out


def _verify_all(p: Paths, what: str, uri: str | None = None) -> None:
    storage = LocalStorage(uri or p.uri)
    for m in read_manifests(storage).all():
        problems = verify_checkpoint(storage, m).problems
        if problems:
            raise Failure(f"after {what}: {m.folder} fails verification: {problems[:3]}")


def _no_leftovers(p: Paths) -> None:
    leftovers = [
        os.path.join(d, f) for d, _, fs in os.walk(p.uri) for f in fs if f.startswith(".tmp-")
    ] + [os.path.join(d, f) for d, _, fs in os.walk(p.spool) for f in fs]
    if leftovers:
        raise Failure(f"temp or spool files left behind: {leftovers[:10]}")


def drive(root: str) -> Results:
    p = Paths(root)
    for d in (p.refs, p.logs):
        os.makedirs(d, exist_ok=True)
    res = Results()
    t0 = time.perf_counter()
    inc = 0
    before: dict[int, str] = {}
    must: set[tuple[int, str]] = set()
    only = os.environ.get("CRASH_ONLY")  # debugging: a comma-separated subset of points
    res.mode = MODE
    for point, nth, rank, mode in plan_for(PLAN):
        if only and point not in only.split(","):
            continue
        inc += 1
        outcome = _trainer_run(p, inc, f"{point}:{nth}", rank, mode)
        carried = _check_restart(p, inc, before, must, res)
        tag = f"trainer-r{rank}{'-full' if mode == 'full' else ''}:{point}:{nth}"
        (res.kills if outcome.startswith("killed") else res.not_reached).append(tag)
        if outcome == "killed-staging":
            res.staging_kills.append(tag)
        before = _committed(p)
        must = carried | _must_commit(before, _pending(p))
    # A clean restart finishes whatever the last kill left.
    inc += 1
    _trainer_run(p, inc, None, 0)
    _check_restart(p, inc, before, must, res)
    _verify_all(p, "the trainer kills")
    if PLAN == "staging":  # merger and GC never stage: the "all" plan kills them
        _tool_run(p, "gc-last", None, "gc")  # (the killed writes' temp files are GC's)
        _verify_all(p, "the last GC")
        _no_leftovers(p)
        res.seconds = time.perf_counter() - t0
        return res

    # Merger kills: each on a copy of the trainer's URI as it is now (so every point finds
    # work), then rerun unarmed; the result must be exactly the uninterrupted merge's.
    snapshot = os.path.join(p.root, "premerge")
    shutil.copytree(p.uri, snapshot)
    _tool_run(p, "merge-ref", None, "merge")
    want = _merged_digest(p.uri)
    if not want:
        raise Failure("the merger committed nothing")
    for i, (point, nth) in enumerate(MERGER_POINTS):
        work = os.path.join(p.root, f"merge{i:02d}")
        shutil.copytree(snapshot, work)
        outcome = _tool_run(p, f"merge{i:02d}", f"{point}:{nth}", "merge", work)
        (res.kills if outcome == "killed" else res.not_reached).append(f"merger:{point}:{nth}")
        _verify_all(p, f"merger kill at {point}:{nth}", work)
        _tool_run(p, f"merge{i:02d}-rerun", None, "merge", work)
        got = _merged_digest(work)
        if got != want:
            raise Failure(
                f"after a kill at {point}:{nth} and a rerun the merged checkpoints differ from an "
                f"uninterrupted merge: {sorted(set(got) ^ set(want))[:5]}"
            )
        _verify_all(p, f"the rerun after {point}:{nth}", work)
        shutil.rmtree(work)
    retained = sorted(plan_retention(read_manifests(LocalStorage(p.uri)), KEEP).retained_steps)
    for i, (point, nth) in enumerate(GC_POINTS):
        outcome = _tool_run(p, f"gc{i:02d}", f"{point}:{nth}", "gc")
        (res.kills if outcome == "killed" else res.not_reached).append(f"gc:{point}:{nth}")
        _verify_all(p, f"GC kill at {point}:{nth}")
    _tool_run(p, "gc-final", None, "gc")
    left = sorted(_committed(p))
    if not set(retained) <= set(left):
        raise Failure(f"GC lost retained steps {sorted(set(retained) - set(left))}")

    # Every retained step restores bitwise through the merged lineage; then training goes on.
    inc += 1
    os.environ["CRASH_VERIFY_STEPS"] = json.dumps(retained)
    _trainer_run(p, inc, None, 0, mode="verify-all")
    before = _committed(p)
    inc += 1
    _trainer_run(p, inc, None, 0)
    _check_restart(p, inc, before, set(), res)
    _tool_run(p, "gc-last", None, "gc")
    _verify_all(p, "the last GC")
    _no_leftovers(p)
    res.seconds = time.perf_counter() - t0
    return res


def _preload() -> None:
    """Import what ``build_model`` imports, once, before any fork: the forked ranks then start
    in a fraction of a second instead of importing TorchRec each."""
    import deck.adapters.torchrec  # noqa: F401
    import fbgemm_gpu.split_embedding_configs  # noqa: F401
    import torchrec
    import torchrec.distributed
    import torchrec.distributed.embedding
    import torchrec.distributed.embeddingbag
    import torchrec.distributed.planner
    import torchrec.models.dlrm
    import torchrec.optim.keyed
    import torchrec.optim.optimizers  # noqa: F401


def main() -> None:
    global MODE, PLAN
    root = sys.argv[1]
    MODE = sys.argv[2] if len(sys.argv) > 2 else "threads"
    PLAN = sys.argv[3] if len(sys.argv) > 3 else "all"
    assert MODE in ("threads", "process") and PLAN in ("all", "staging"), sys.argv
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    _preload()
    out: dict[str, Any]
    try:
        res = drive(root)
        out = {"ok": True, **res.__dict__}
    except Failure as e:
        out = {"ok": False, "error": str(e)}
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1)[:20000])


if __name__ == "__main__":
    main()
