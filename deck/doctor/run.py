"""Run the check: spawn N gloo CPU ranks, train the user's setup with deck, capture the live
state at the last checkpoint, train on, restore into a fresh build, compare, train on again."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from deck.config import DeckConfig
from deck.doctor.capture import (
    KINDS,
    Captured,
    capture,
    compare,
    count,
    recheck_created_buffers,
)
from deck.doctor.report import (
    DECK_ERROR,
    LOSS,
    RESTORE,
    Difference,
    DoctorReport,
    loss_differences,
)
from deck.doctor.setup import DoctorSetup, build_setup, load_entry, normalize_entry
from deck.errors import DeckError, DoctorError
from deck.processes import end_rank, init_process_group, meeting_file
from deck.read.catalog import list_checkpoints
from deck.storage import check_writable, open_storage
from deck.trainer.checkpointer import DeltaCheckpointer, enable

_ORDER = (*KINDS, RESTORE, LOSS, DECK_ERROR)


@dataclass(frozen=True)
class DoctorPlan:
    """What every rank runs (plain fields: it travels to the spawned ranks)."""

    entry: str
    steps: int
    every: int
    more: int
    uri: str
    storage_options: dict[str, Any] | None
    work: str  # a private folder where the ranks leave their results
    progress: bool


def run_doctor(
    entry: str,
    *,
    ranks: int = 2,
    steps: int = 6,
    every: int = 2,
    more: int = 4,
    uri: str | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool = True,
) -> DoctorReport:
    """Check that deck restores the user's setup exactly, on ``ranks`` gloo CPU ranks.

    ``entry`` (``package.module:function`` or ``path/to/file.py:function``) returns a
    :class:`DoctorSetup` on every rank. The setup trains steps 1..``steps`` with deck (a full at
    step 0, then a checkpoint every ``every`` steps), its live state at step ``steps`` is
    captured with torch's/TorchRec's public APIs, and it trains ``more`` steps on; a fresh setup
    then restores step ``steps`` with deck, is compared bitwise with the capture, and trains the
    same ``more`` steps. The report lists every difference per rank (entries and losses) and
    ``passed`` is True only when there is none. A deck error while enabling, checkpointing or
    restoring is a difference too. Checkpoints go to ``uri`` (an empty one; default: a temporary
    folder, removed afterwards). Progress goes to stderr unless ``progress`` is False.

    Raises :class:`DoctorError` for usage errors: arguments, an entry point that cannot be
    imported or returns no DoctorSetup, the user's own code raising, a rank dying.
    """
    check_numbers(ranks, steps, every, more)
    entry = normalize_entry(entry)
    load_entry(entry)  # an import error is reported before any rank starts
    with tempfile.TemporaryDirectory(prefix="deck-doctor-") as work:
        target = uri or os.path.join(work, "checkpoints")
        if uri is not None:
            _check_uri(uri, storage_options)
        plan = DoctorPlan(entry, steps, every, more, target, storage_options, work, progress)
        _say(plan, f"starting {ranks} gloo ranks; checkpoints go to {target}")
        try:
            with meeting_file(work) as where:
                mp.spawn(_rank_main, args=(ranks, where, plan), nprocs=ranks, join=True)
        except ProcessException as e:
            report = _failed(plan, ranks, e)
        else:
            report = _report(plan, ranks, json.loads((Path(work) / "result.json").read_text()))
    report.uri = uri  # None: the temporary folder is gone
    return report


def _check_uri(uri: str, storage_options: dict[str, Any] | None) -> None:
    """An empty store the doctor can write, or a :class:`DoctorError` (break-it findings: a
    folder of the user's own files was written into, and a store that cannot be written was
    reported as a difference of the setup, exit 1, not as an error that stopped it)."""
    storage = open_storage(uri, storage_options)
    if list_checkpoints(storage):
        raise DoctorError(f"uri {uri} holds checkpoints already: give the doctor an empty one")
    if storage.list_dir(""):
        raise DoctorError(
            f"uri {uri} is not empty: give the doctor an empty folder (it writes its "
            "checkpoints there and leaves them)"
        )
    try:
        check_writable(storage)
    except DeckError as e:
        raise DoctorError(str(e)) from e


PARAMETERS = ("ranks", "steps", "every", "more")


def check_numbers(
    ranks: int, steps: int, every: int, more: int, names: tuple[str, ...] = PARAMETERS
) -> None:
    """Raise :class:`DoctorError` unless the run's numbers make sense; the message calls them
    ``names`` (the parameters; the CLI passes its flags)."""
    r, s, e, m = names
    if ranks < 1 or every < 1 or more < 1 or steps < every:
        raise DoctorError(
            f"need {r} >= 1, {e} >= 1, {s} >= {e} and {m} >= 1; got ranks "
            f"{ranks}, steps {steps}, every {every}, more {more}"
        )
    if steps % every:
        raise DoctorError(
            f"{s} {steps} must be a multiple of {e} {every}: the restored step is the "
            "last one trained"
        )


# ---- on every rank ------------------------------------------------------------------------------


class _Failure(Exception):
    """A phase of a rank failed: ``who`` is "user" (their code: a usage error) or "deck"."""

    def __init__(self, who: str, phase: str, error: BaseException):
        super().__init__(f"{phase}: {type(error).__name__}: {error}")
        self.who, self.phase, self.error = who, phase, error


@contextmanager
def _phase(who: str, phase: str) -> Iterator[None]:
    try:
        yield
    except _Failure:
        raise
    except Exception as e:
        raise _Failure(who, phase, e) from e


def _rank_main(rank: int, world_size: int, where: str, plan: DoctorPlan) -> None:
    _quiet_rank()
    init_process_group(rank, world_size, where)
    try:
        results = _gather_json(_check_rank(plan, rank))
    except _Failure as f:
        _write(
            Path(plan.work) / f"rank-{rank:05d}.error.json",
            {"rank": rank, "who": f.who, "phase": f.phase, "error": _text(f.error)},
        )
        # Leave at once: the other ranks may wait in a collective; the parent stops them.
        sys.stderr.flush()
        os._exit(3)
    if rank == 0:
        _write(Path(plan.work) / "result.json", results)
    end_rank()


def _check_rank(plan: DoctorPlan, rank: int) -> dict[str, Any]:
    k, m = plan.steps, plan.more
    say = (lambda text: _say(plan, text)) if rank == 0 else (lambda text: None)
    say(f"[1/5] building the setup: {plan.entry}")
    setup = _build(plan, "the entry point")
    config = _config(setup, plan)
    say(f"[2/5] training steps 1..{k} with deck (a full at 0, a checkpoint every {plan.every})")
    ckpt = _enable(setup, config)
    _train(setup, ckpt, range(0, k + 1))
    live = _capture(setup, f"capturing the live state at step {k}")
    say(f"[3/5] training steps {k + 1}..{k + m} on: the losses of never stopping")
    losses = _train(setup, ckpt, range(k + 1, k + m + 1))
    _close(ckpt)
    say(f"[4/5] building a fresh setup and restoring step {k} into it with deck")
    fresh = _build(plan, "the entry point (fresh build)")
    ckpt = _enable(fresh, config)
    with _phase("deck", f"restore of step {k}"):
        restored = ckpt.restore(k)
    differences = compare(live, _capture(fresh, "capturing the restored state"))
    say(
        f"[5/5] compared {sum(count(live).values())} entries on this rank; training steps "
        f"{k + 1}..{k + m} on"
    )
    after = _train(fresh, ckpt, range(k + 1, k + 2))
    differences = recheck_created_buffers(differences, live, fresh.model)
    after += _train(fresh, ckpt, range(k + 2, k + m + 1))
    _close(ckpt)
    return {
        "rank": rank,
        "checked": count(live),
        "differences": differences,
        "losses": losses,
        "after": after,
        "restored": restored,
    }


def _build(plan: DoctorPlan, phase: str) -> DoctorSetup:
    with _phase("user", phase):
        return build_setup(plan.entry)


def _config(setup: DoctorSetup, plan: DoctorPlan) -> DeckConfig:
    fields = {**setup.config, "uri": plan.uri, "delta_every_steps": plan.every}
    if plan.storage_options is not None:
        fields["storage_options"] = plan.storage_options
    with _phase("user", "DeckConfig(**DoctorSetup.config)"):
        return DeckConfig(**fields)


def _enable(setup: DoctorSetup, config: DeckConfig) -> DeltaCheckpointer:
    with _phase("deck", "deck.enable"):
        return enable(setup.model, setup.optimizers, config, state=setup.state)


def _train(setup: DoctorSetup, ckpt: DeltaCheckpointer, steps: range) -> list[float]:
    """Train ``steps`` (step 0 only checkpoints) with ``ckpt.step`` after each; the losses."""
    losses = []
    for step in steps:
        if step:
            with _phase("user", f"train_step({step})"):
                losses.append(_loss(setup.train_step(step)))
        with _phase("deck", f"checkpoint of step {step}"):
            ckpt.step(step)
    return losses


def _loss(value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, (int, float)):
        return float(value)
    raise DoctorError(
        f"returned {type(value).__name__}; DoctorSetup.train_step must return the step's loss "
        "(a float or a one-element tensor)"
    )


def _capture(setup: DoctorSetup, phase: str) -> Captured:
    with _phase("user", phase):  # calls the user's state_dict()
        return capture(setup)


def _close(ckpt: DeltaCheckpointer) -> None:
    with _phase("deck", "flush (waiting for the commits)"):
        if not ckpt.flush():
            raise DeckError("a checkpoint did not commit (see the log above)")
        ckpt.close()


def _gather_json(value: Any) -> list[Any]:
    """Every rank's JSON-able ``value``, by rank, on every rank (no pickle: JSON bytes)."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()]))
    longest = int(max(sizes).item())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: data.numel()] = data
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(out, mine)
    return [json.loads(o[: int(n)].numpy().tobytes()) for o, n in zip(out, sizes, strict=True)]


def _quiet_rank() -> None:
    # TorchRec's planner and deprecation warnings on every build would bury the progress lines.
    faulthandler.enable(all_threads=True)
    warnings.filterwarnings("ignore")
    for name in ("torchrec", "torch", "root"):
        logging.getLogger(None if name == "root" else name).setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# ---- in the parent ------------------------------------------------------------------------------


def _report(plan: DoctorPlan, ranks: int, results: list[dict[str, Any]]) -> DoctorReport:
    report = _empty(plan, ranks)
    report.checked = {k: sum(r["checked"][k] for r in results) for k in KINDS}
    found: list[Difference] = []
    for r in results:
        rank = r["rank"]
        found += [Difference(rank, kind, name, what) for kind, name, what in r["differences"]]
        if r["restored"] != plan.steps:
            found.append(
                Difference(
                    rank, RESTORE, "restore()", f"returned {r['restored']}, not {plan.steps}"
                )
            )
        found += loss_differences(rank, plan.steps + 1, r["losses"], r["after"])
        report.losses.append(r["losses"])
        report.losses_after_restore.append(r["after"])
    # The same entry on every rank: adjacent lines.
    report.differences = sorted(found, key=lambda d: (_ORDER.index(d.kind), d.name, d.rank))
    return report


def _failed(plan: DoctorPlan, ranks: int, error: Exception) -> DoctorReport:
    """The report of a run a rank left: a deck failure is a finding, anything else a usage error."""
    records = [json.loads(p.read_text()) for p in sorted(Path(plan.work).glob("rank-*.error.json"))]
    if not records:
        raise DoctorError(f"a rank died without a report ({error}); its output above says why")
    for r in records:
        if r["who"] == "user":
            raise DoctorError(f"rank {r['rank']}: {r['phase']} failed: {r['error']}")
    report = _empty(plan, ranks)
    report.differences = [
        Difference(r["rank"], DECK_ERROR, r["phase"], r["error"]) for r in records
    ]
    return report


def _empty(plan: DoctorPlan, ranks: int) -> DoctorReport:
    return DoctorReport(plan.entry, ranks, plan.steps, plan.every, plan.more, plan.uri)


def _say(plan: DoctorPlan, text: str) -> None:
    if plan.progress:
        print(f"deck doctor: {text}", file=sys.stderr, flush=True)


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _write(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value))
