"""Which merger worker this process is: an explicit index / count (``MergeConfig``'s
``worker_index`` / ``num_workers``; ``deck merge --worker-index / --num-workers``), or the
standard launchers' environment.

Sources, innermost launcher first (a torchrun started by ``srun`` or in a Kubernetes pod sees
the outer launcher's variables too, and its own describe this process):

1. torchrun (and anything else setting them): ``RANK`` / ``WORLD_SIZE``.
2. Kubernetes Indexed Job: ``JOB_COMPLETION_INDEX``; Kubernetes sets no count, so it comes from
   the explicit count or ``DECK_NUM_WORKERS`` (the Job's ``completions``).
3. SLURM (under ``srun``): ``SLURM_PROCID`` / ``SLURM_NTASKS``.

Explicit values win over the environment. ``DECK_NUM_WORKERS``, when set, must agree with the
count of the source used; a count given twice that disagrees, an index without a count, or an
index outside ``[0, count)`` is a :class:`~deck.errors.ConfigError` naming the variables
(and the explicit values by the names the caller gives: the CLI passes its flags).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from deck.errors import ConfigError

logger = logging.getLogger(__name__)

COUNT_VAR = "DECK_NUM_WORKERS"
# What errors and WorkerSlot.source call the explicit index and count unless the caller names them.
NAMES = ("worker_index", "num_workers")


@dataclass(frozen=True)
class WorkerSlot:
    """This process's merger worker index and the number of such processes (hosts / pods /
    tasks), and where they came from (for logs)."""

    index: int
    count: int
    source: str


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not an integer") from None


def _from_env(
    env: Mapping[str, str], names: tuple[str, str]
) -> tuple[int, int | None, str, str] | None:
    """(index, count, where the index came from, where the count came from) of the innermost
    launcher found in ``env``, else None; ``names`` name the explicit index and count."""
    if "RANK" in env or "WORLD_SIZE" in env:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            have, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
            raise ConfigError(
                f"${have} is set but ${missing} is not (torchrun sets both): unset it or pass "
                f"{names[0]} and {names[1]}"
            )
        return (
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            f"torchrun $RANK={env['RANK']}",
            f"$WORLD_SIZE={env['WORLD_SIZE']}",
        )
    if "JOB_COMPLETION_INDEX" in env:
        has_count = COUNT_VAR in env
        return (
            _int(env, "JOB_COMPLETION_INDEX"),
            _int(env, COUNT_VAR) if has_count else None,
            f"Kubernetes Indexed Job $JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']}",
            f"${COUNT_VAR}={env[COUNT_VAR]}" if has_count else "",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return (
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS"),
            f"SLURM $SLURM_PROCID={env['SLURM_PROCID']}",
            f"$SLURM_NTASKS={env['SLURM_NTASKS']}",
        )
    return None


def resolve_worker(
    index: int | None,
    count: int | None,
    env: Mapping[str, str] | None = None,
    *,
    names: tuple[str, str] = NAMES,
    announce: bool = True,
) -> WorkerSlot:
    """This process's worker slot from the explicit ``index`` and ``count`` (``None``: not
    given) and ``env`` (default ``os.environ``). Both given: they are used as they are. Otherwise
    the missing values come from the innermost launcher in ``env``; with neither explicit values
    nor a launcher, worker 0 of 1. Raises :class:`ConfigError` naming the values / variables that
    disagree or are missing; ``names`` are what it calls ``index`` and ``count`` (the CLI passes
    its flags)."""
    env = os.environ if env is None else env
    index_name, count_name = names
    if index is not None and count is not None:
        slot = WorkerSlot(index, count, f"{index_name}/{count_name}")
    else:
        found = _from_env(env, names)
        if found is None:
            if index is not None or count is not None:
                given = index_name if index is not None else count_name
                other = count_name if index is not None else index_name
                raise ConfigError(
                    f"{given} needs {other} too (no launcher environment provides it: torchrun's "
                    "RANK/WORLD_SIZE, a Kubernetes Indexed Job's JOB_COMPLETION_INDEX, SLURM's "
                    "SLURM_PROCID/SLURM_NTASKS)"
                )
            slot = WorkerSlot(0, 1, "default (no explicit values, no launcher environment)")
        else:
            env_index, env_count, index_src, count_src = found
            if count is not None and env_count is not None and count != env_count:
                raise ConfigError(
                    f"{count_name} {count} disagrees with {count_src}; give one of them"
                )
            if count is None and env_count is None:
                raise ConfigError(
                    f"{index_src} gives this worker's index but nothing gives the number of "
                    f"workers (Kubernetes sets no count): pass {count_name} N or set "
                    f"{COUNT_VAR}=N (the Job's completions)"
                )
            final_count = count if count is not None else env_count
            assert final_count is not None
            parts = [index_src if index is None else index_name]
            parts.append(count_src if count is None else count_name)
            slot = WorkerSlot(
                env_index if index is None else index,
                final_count,
                ", ".join(parts),
            )
            if COUNT_VAR in env and count_src != f"${COUNT_VAR}={env[COUNT_VAR]}":
                n = _int(env, COUNT_VAR)
                if n != slot.count:
                    raise ConfigError(
                        f"${COUNT_VAR}={n} disagrees with the {slot.count} workers from "
                        f"{slot.source}; unset one"
                    )
    if slot.count < 1 or not 0 <= slot.index < slot.count:
        raise ConfigError(
            f"worker index {slot.index} of {slot.count} workers (from {slot.source}): need "
            "0 <= index < count"
        )
    if announce:  # (deck merge --workers K says which workers the slot runs instead)
        logger.info("deck merge: worker %d of %d (from %s)", slot.index, slot.count, slot.source)
    return slot
