"""The pool of CPU chunk buffers the training thread fills, sized from what the job saves."""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from deck.format.chunks import Buffer, aligned_buffer

PAGE = 4096


class BufferPool:
    """Reusable buffers of ``size`` bytes, allocated on first use; at most :attr:`count` exist
    at once (the memory bound: :meth:`acquire` blocks beyond it).

    The count starts at ``floor`` and follows :meth:`size_for`: it grows to what a part needs, up
    to ``cap`` buffers, so a steady workload never waits for a buffer; when it shrinks, buffers
    beyond it are freed as they come back. :meth:`prefault` allocates and touches the missing
    buffers ahead of use (from a background thread), so a grown pool's first use does not take
    page faults in the training stall.

    With ``pinned`` (tables on a GPU) buffers are page-locked host memory, so device-to-host
    copies into them are true DMA transfers that can run on a side stream.
    """

    def __init__(self, floor: int, size: int, cap: int | None = None, pinned: bool = False):
        self.size = size
        self.floor = floor
        self.cap = max(floor, cap if cap is not None else floor)
        self.count = floor
        self.pinned = pinned
        self._owners: dict[int, torch.Tensor] = {}  # id(buffer) -> owner of a pinned buffer
        self._free: queue.LifoQueue[Buffer] = queue.LifoQueue()
        self._allocated = 0
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak_in_use = 0

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.size

    def _new(self) -> Buffer:
        if not self.pinned:
            return aligned_buffer(self.size)
        owner = torch.empty(self.size, dtype=torch.uint8, pin_memory=True)
        buf = memoryview(owner.numpy())  # type: ignore[arg-type]
        self._owners[id(buf)] = owner
        return buf

    def size_for(self, needed: int) -> bool:
        """Make the pool ``needed`` buffers (within ``floor`` .. ``cap``). Returns whether the
        cap won (fewer buffers than ``needed``: a part that large waits for buffers)."""
        with self._lock:
            self.count = min(self.cap, max(self.floor, needed))
        return needed > self.cap

    def prefault(self) -> None:
        """Allocate the buffers the pool may still create, touching every page (background)."""
        while True:
            with self._lock:
                if self._allocated >= self.count:
                    return
                self._allocated += 1
            buf = self._new()
            np.frombuffer(buf, dtype=np.uint8)[::PAGE] = 0  # one write per page faults it in
            self._free.put(buf)

    def acquire(self) -> Buffer:
        """A free buffer; blocks while :attr:`count` are in use (this is the memory bound)."""
        with self._lock:
            grow = self._free.empty() and self._allocated < self.count
            if grow:
                self._allocated += 1
        if grow:
            self._free.put(self._new())
        buf = self._free.get()
        with self._lock:
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def release(self, buf: Buffer) -> None:
        """Return ``buf``; freed instead when the pool holds more buffers than :attr:`count`."""
        with self._lock:
            self.in_use -= 1
            drop = self._allocated > self.count
            if drop:
                self._allocated -= 1
                self._owners.pop(id(buf), None)
        if not drop:
            self._free.put(buf)
