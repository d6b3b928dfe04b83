"""Run a function on N real gloo ranks (spawned processes) from a test."""

from __future__ import annotations

import faulthandler
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from deck.processes import end_rank, init_process_group, meeting_file

WATCHDOG_ENV = "DECK_RANK_WATCHDOG_S"
"""Seconds after which a spawned rank dumps its threads' stacks and exits (unset or 0: never)."""


def _entry(
    rank: int, world_size: int, where: str, fn: Callable[..., None], args: tuple[Any, ...]
) -> None:
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack
    watchdog = float(os.environ.get(WATCHDOG_ENV, "0"))
    if watchdog > 0:
        # A hung rank prints every thread's stack and exits, so the test fails saying where
        # it stopped instead of pytest's timeout showing only the parent waiting in spawn.
        faulthandler.dump_traceback_later(watchdog, exit=True)
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_process_group(rank, world_size, where)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    end_rank()


def run_ranks(fn: Callable[..., None], *args: Any, world_size: int = 2) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; re-raises a rank's failure.

    ``fn`` must be a module-level function (spawned processes import it by name).
    """
    with meeting_file() as where:
        mp.spawn(_entry, args=(world_size, where, fn, args), nprocs=world_size, join=True)
