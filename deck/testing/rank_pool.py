"""A pool of spawned gloo ranks that runs one function after another (a generative test's many
examples without a process start per example)."""

from __future__ import annotations

import datetime
import os
import queue
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from deck.processes import end_rank, remove_meeting_file, rendezvous


def _serve(rank: int, world_size: int, where: str, inbox: Any, outbox: Any) -> None:
    import faulthandler
    import logging
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: every stack

    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("deck").setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    # A collective one rank never joins fails after this long instead of hanging the pool.
    dist.init_process_group(
        "gloo",
        init_method=where,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=30),
    )
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    end_rank()


class RankPool:
    """``world_size`` processes in one gloo group. :meth:`run` calls ``fn(rank, world_size,
    *args)`` on each and returns their results by rank; a rank's exception or a timeout raises
    :class:`RankFailure` and leaves the pool unusable (start a new one)."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.where = where = rendezvous()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, where, self.inboxes[r], self.outbox),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 300) -> list[Any]:
        if self.broken:
            raise RuntimeError("this RankPool failed before; start a new one")
        for q in self.inboxes:
            q.put((fn, args))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.outbox.get(timeout=timeout_s)
            except queue.Empty:
                self.broken = True
                self.close()
                raise RankFailure(
                    f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(results) - set(errors))} "
                    f"gave no result within {timeout_s:.0f} s; errors: {errors}"
                ) from None
            (results if ok else errors)[rank] = value
        if errors:
            self.broken = True
            self.close()
            raise RankFailure(
                "\n".join(
                    f"rank {r} failed in {fn.__name__}:\n...{tb[-1500:]}"
                    for r, tb in sorted(errors.items())
                )
            )
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for p, q in zip(self.procs, self.inboxes, strict=True):
            if p.is_alive() and not self.broken:
                q.put(None)
        for p in self.procs:
            p.join(timeout=20 if not self.broken else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        remove_meeting_file(self.where)


class RankFailure(AssertionError):
    """A rank of a :class:`RankPool` raised or did not answer."""
