"""The pool of CPU chunk buffers the training thread fills, sized from what the job saves."""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections.abc import Callable

import numpy as np
import torch

from deck.format.chunks import Buffer, aligned_buffer

PAGE = 4096


class BufferPool:
    """Reusable buffers of ``size`` bytes, allocated on first use; at most :attr:`count` exist
    at once (the memory bound: :meth:`acquire` blocks beyond it).

    The count starts at ``floor`` and follows :meth:`size_for`: it grows to what a part needs, up
    to ``cap`` buffers, so a steady workload never waits for a buffer; when it shrinks, buffers
    beyond it are freed as they come back (unless a caller is waiting for one: a delta right
    after a full takes the full's buffers as they are written, instead of waiting for all of
    them, and the first ``count`` back are kept warm) and free ones by :meth:`trim`.
    :meth:`prefault` allocates and touches the missing buffers ahead of use; both run on a
    background thread, so neither page faults nor unmapping fall in the stall.

    With ``pinned`` (tables on a GPU) buffers are page-locked host memory, so device-to-host
    copies into them are true DMA transfers that can run on a side stream.

    With ``shared`` each buffer is a memfd (Linux shared memory) mapped here, numbered by a
    slot that is never reused (:meth:`shared_slot`), so that a staging process can map the same
    pages; ``on_forget(slot)`` runs when the pool frees one (the other side unmaps it too).
    """

    def __init__(
        self,
        floor: int,
        size: int,
        cap: int | None = None,
        pinned: bool = False,
        shared: bool = False,
    ):
        self.size = size
        self.floor = floor
        self.cap = max(floor, cap if cap is not None else floor)
        self.count = floor
        self.pinned = pinned
        self.shared = shared
        self.on_forget: Callable[[int], None] | None = None
        self._slots: dict[int, tuple[int, int]] = {}  # id(buffer) -> (slot, memfd)
        self._next_slot = itertools.count()
        self._owners: dict[int, torch.Tensor] = {}  # id(buffer) -> owner of a pinned buffer
        self._free: list[Buffer] = []  # last in, first out: the warmest buffer first
        self._allocated = 0
        self._waiting = 0
        self._cond = threading.Condition()
        self.in_use = 0
        self.peak_in_use = 0

    @property
    def allocated(self) -> int:
        """Buffers that exist now (free or in use)."""
        return self._allocated

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.size

    def _new(self) -> Buffer:
        if self.shared:
            fd = os.memfd_create("deck-chunk", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.size)
                view = memoryview(mmap.mmap(fd, self.size))
            except BaseException:
                os.close(fd)
                raise
            with self._cond:
                self._slots[id(view)] = (next(self._next_slot), fd)
            return view
        if not self.pinned:
            return aligned_buffer(self.size)
        owner = torch.empty(self.size, dtype=torch.uint8, pin_memory=True)
        buf = memoryview(owner.numpy())  # type: ignore[arg-type]
        with self._cond:
            self._owners[id(buf)] = owner
        return buf

    def shared_slot(self, buf: Buffer) -> tuple[int, int]:
        """A shared buffer's (slot, memfd)."""
        with self._cond:
            return self._slots[id(buf)]

    def _forget(self, buf: Buffer) -> None:
        """``buf`` is freed (under the lock): a shared one's memfd is closed and its slot
        forgotten (the pages go once every mapping is gone)."""
        self._owners.pop(id(buf), None)
        got = self._slots.pop(id(buf), None)
        if got is not None:
            os.close(got[1])
            if self.on_forget is not None:
                self.on_forget(got[0])

    def size_for(self, needed: int) -> bool:
        """Make the pool ``needed`` buffers (within ``floor`` .. ``cap``). Returns whether the
        cap won (fewer buffers than ``needed``: a part that large waits for buffers)."""
        with self._cond:
            self.count = min(self.cap, max(self.floor, needed))
            self._cond.notify_all()  # a waiting acquire may now allocate
        return needed > self.cap

    def trim(self) -> None:
        """Free free buffers while more than :attr:`count` exist (background: unmapping a
        buffer costs page-table work and TLB shootdowns)."""
        while True:
            with self._cond:
                if self._allocated <= self.count or not self._free:
                    return
                buf = self._free.pop(0)  # the coldest
                self._allocated -= 1
                self._forget(buf)
            del buf

    def prefault(self) -> None:
        """Allocate the buffers the pool may still create, touching every page (background)."""
        while True:
            with self._cond:
                if self._allocated >= self.count:
                    return
                self._allocated += 1
            buf = self._new()
            np.frombuffer(buf, dtype=np.uint8)[::PAGE] = 0  # one write per page faults it in
            with self._cond:
                self._free.append(buf)
                self._cond.notify()

    def acquire(self) -> Buffer:
        """A free buffer; blocks while :attr:`count` are in use (this is the memory bound)."""
        buf = self._take(block=True)
        assert buf is not None
        return buf

    def try_acquire(self) -> Buffer | None:
        """A free buffer, or None (at once) while :attr:`count` are in use."""
        return self._take(block=False)

    def _take(self, block: bool) -> Buffer | None:
        with self._cond:
            while not self._free and self._allocated >= self.count:
                if not block:
                    return None
                self._waiting += 1
                self._cond.wait()
                self._waiting -= 1
            buf = self._free.pop() if self._free else None
            if buf is None:
                self._allocated += 1
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return self._new() if buf is None else buf

    def release(self, buf: Buffer) -> None:
        """Return ``buf``; freed instead when the pool holds more buffers than :attr:`count`,
        nobody waits for one and :attr:`count` are free already. So while a full's borrowed
        buffers drain, the first ones back stay warm for the next delta (which then neither
        waits for the full's writes nor faults in new pages), and the pool never holds more
        than it held at its peak."""
        with self._cond:
            self.in_use -= 1
            if self._allocated > self.count and not self._waiting and len(self._free) >= self.count:
                self._allocated -= 1
                self._forget(buf)
                return
            self._free.append(buf)
            self._cond.notify()
