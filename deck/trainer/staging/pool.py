"""The bounded pool of CPU chunk buffers the training thread fills."""

from __future__ import annotations

import queue
import threading

import torch

from deck.format.chunks import Buffer, aligned_buffer


class BufferPool:
    """``count`` reusable buffers of ``size`` bytes, allocated on first use.

    With ``pinned`` (tables on a GPU) buffers are page-locked host memory, so device-to-host
    copies into them are true DMA transfers that can run on a side stream.
    """

    def __init__(self, count: int, size: int, pinned: bool = False):
        self.size = size
        self.count = count
        self.pinned = pinned
        self._keep: list[torch.Tensor] = []  # owners of pinned buffers
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
        self._keep.append(owner)
        return memoryview(owner.numpy())  # type: ignore[arg-type]

    def acquire(self) -> Buffer:
        """A free buffer; blocks while ``count`` are in use (this is the memory bound)."""
        with self._lock:
            if self._free.empty() and self._allocated < self.count:
                self._allocated += 1
                self._free.put(self._new())
        buf = self._free.get()
        with self._lock:
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def release(self, buf: Buffer) -> None:
        with self._lock:
            self.in_use -= 1
        self._free.put(buf)
