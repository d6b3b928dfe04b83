"""Test support: driving a stager by hand, as the checkpointer does; a synthetic two-rank job
whose parts go through stagers (:class:`StagedSynth`), and the order of a store's puts
(:class:`PutOrder`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from deck.config import StagingConfig
from deck.format.manifest import Kind
from deck.format.pending import PendingPart
from deck.storage import Storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.synth import SynthTrainer
from deck.trainer.staging import CheckpointStats, Stager

T = TypeVar("T")


def full_part_info(
    uri: str, step: int, ckpt_id: str, rank: int = 0, world_size: int = 1, **more: Any
) -> PendingPart:
    """The pending record of rank ``rank``'s part of a full checkpoint of ``step`` (epoch 0);
    ``more``: other fields (``part``, ...)."""
    return PendingPart(
        uri=uri,
        step=step,
        ckpt_id=ckpt_id,
        rank=rank,
        world_size=world_size,
        kind=Kind.FULL,
        parent=None,
        parent_id=None,
        base=step,
        epoch=0,
        **more,
    )


class StagedSynth(SynthTrainer):
    """A :class:`~deck.testing.synth.SynthTrainer` whose ranks checkpoint through a
    :class:`~deck.trainer.staging.Stager` each (rank ``r``'s spool in ``spool/rank-r``), driven
    by hand as each rank's checkpointer drives its own, without the collectives: every rank
    stages every part. :meth:`stage` returns at once; the parts go up and commit in the
    background, rank 0 writing the commit records."""

    def __init__(self, storage: Storage, staging: StagingConfig, spool: str, **kw: Any) -> None:
        super().__init__(storage, **kw)
        self.stagers = [
            Stager(storage, staging.model_copy(update={"spool_dir": f"{spool}/rank-{r}"}), r)
            for r in range(self.world_size)
        ]

    def stage(self, kind: str = "delta", *, one_by_one: bool = False) -> list[CheckpointStats]:
        """Stage a checkpoint of the current step on every rank (rank 0 last); each rank's stats
        of it, by rank. ``one_by_one``: each rank's part is up before the next rank stages."""
        kind, ckpt_id = self.next_checkpoint(kind)
        full = kind == "full"
        info = PendingPart(
            uri=self.storage.uri,
            step=self.step,
            ckpt_id=ckpt_id,
            rank=0,
            world_size=self.world_size,
            kind=Kind.FULL if full else Kind.DELTA,
            parent=None if full or self.parent is None else self.parent[0],
            parent_id=None if full or self.parent is None else self.parent[1],
            base=self.step if full or self.base is None else self.base,
            epoch=self.epoch,
        )
        out = []
        for rank in reversed(range(self.world_size)):
            stager = self.stagers[rank]
            staged = stager.begin(info.model_copy(update={"rank": rank}), reserved=0)
            self.write_part(rank, ckpt_id, full, sink=staged)
            stats = CheckpointStats(step=self.step, kind=kind, id=ckpt_id)
            stager.enqueue(staged, stats)
            if one_by_one:
                stager.flush()
            out.append(stats)
        self.saved_as(ckpt_id, kind)
        return out[::-1]

    def flush(self) -> None:
        for stager in self.stagers:
            stager.flush()

    def close(self) -> None:
        for stager in self.stagers:
            stager.close()


class PutOrder(StorageWrapper):
    """Forwards to ``inner``, recording when each put began and ended in one sequence
    (:attr:`log`: ``("begin" | "end" | "failed", key)``), so a test sees which write came
    before which. ``before_put(key)`` runs as a put begins: it may wait (for another put, with
    :meth:`wait_ended`) or raise (the put fails with that error)."""

    def __init__(self, inner: Storage, before_put: Callable[[str], None] | None = None) -> None:
        super().__init__(inner)
        self.log: list[tuple[str, str]] = []
        self.before_put = before_put
        self._changed = threading.Condition()

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self._put(path, lambda: self.inner.put(path, data))

    def put_if_absent(self, path: str, data: bytes | bytearray | memoryview) -> bool:
        return self._put(path, lambda: self.inner.put_if_absent(path, data))

    def _put(self, path: str, put: Callable[[], T]) -> T:
        self._note("begin", path)
        try:
            if self.before_put is not None:
                self.before_put(path)
            done = put()
        except BaseException:
            self._note("failed", path)
            raise
        self._note("end", path)
        return done

    def _note(self, event: str, path: str) -> None:
        with self._changed:
            self.log.append((event, path))
            self._changed.notify_all()

    def at(self, event: str, key: str) -> int:
        """Where in :attr:`log` ``key``'s put had ``event`` (ValueError if it never did)."""
        with self._changed:
            return self.log.index((event, key))

    def puts(self, event: str = "end") -> list[str]:
        """The keys whose put had ``event``, in order."""
        with self._changed:
            return [k for e, k in self.log if e == event]

    def wait_ended(self, match: Callable[[str], bool], timeout: float = 120.0) -> bool:
        """Wait until the put of a key ``match`` accepts has ended; False after ``timeout``
        (a safety net: the order a test waits for never came)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: any(e == "end" and match(k) for e, k in self.log), timeout
            )
