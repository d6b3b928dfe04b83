"""The few collectives a checkpoint needs, over torch.distributed (or none for one process).

Only the training thread calls these: a background thread must never issue collectives.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import TypeVar

import torch
import torch.distributed as dist
import xxhash

import deck.errors as errors


class Coordinator:
    """Rank, world size and agreement among ranks of the default (or given) process group."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self._active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self._active else 0
        self.world_size = dist.get_world_size(group) if self._active else 1

    def gather(self, values: list[float]) -> torch.Tensor:
        """Every rank's ``values`` as a (world_size, len(values)) float64 tensor, on every rank."""
        mine = torch.tensor(values, dtype=torch.float64)
        if not self._active:
            return mine.view(1, -1)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return torch.stack(out)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if not self._active:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(
            t, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
        )
        return int(t.item())

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, indexed by rank, on every rank (two all-gathers: lengths, then
        the bytes padded to the longest; no pickle)."""
        if not self._active:
            return [data]
        sizes = self.gather([float(len(data))])[:, 0].long().tolist()
        if not any(sizes):
            return [b""] * self.world_size
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else 0
        out = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(out, buf, group=self.group)
        return [bytes(t[:n].tolist()) for t, n in zip(out, sizes, strict=True)]

    def agree_on_failure(self, error: BaseException | None, what: str) -> None:
        """Collective: raise on every rank if ``error`` is set on any, so that no rank goes on
        into a collective the others will never join. The rank that failed raises its own
        error; the others a :class:`deck.errors.DeckError` of the same class (when it is one)
        naming that rank and its message."""
        mine = b"" if error is None else f"{type(error).__name__}\n{str(error)[:4000]}".encode()
        failed = [(r, m) for r, m in enumerate(self.gather_bytes(mine)) if m]
        if error is not None:
            raise error
        if not failed:
            return
        rank, message = failed[0]
        name, _, text = message.decode(errors="replace").partition("\n")
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.DeckError)):
            cls = errors.DeckError
        raise cls(f"{what} failed on rank {rank} ({name}): {text}")

    def agree_on_values(self, values: dict[str, str], what: str) -> None:
        """Collective: raise :class:`deck.errors.ConfigError` on every rank unless every rank
        passed the same ``values`` (compared by digest; the error names the keys that differ
        and the ranks, not the values, which may hold credentials)."""
        mine = {k: xxhash.xxh3_64_hexdigest(v.encode()) for k, v in sorted(values.items())}
        every = [json.loads(b) for b in self.gather_bytes(json.dumps(mine).encode())]
        differ = sorted(k for k in mine if len({str(d.get(k)) for d in every}) > 1)
        differ += sorted({k for d in every for k in d} - set(mine))
        if differ:
            ranks = [r for r, d in enumerate(every) if d != every[0]]
            raise errors.ConfigError(
                f"{what}: ranks {[0, *ranks]} disagree on {', '.join(differ[:8])}: every rank "
                "must pass the same configuration (a rank that checkpoints at other steps, or "
                "into another URI, would wait forever for the others)"
            )

    def new_id_seed(self) -> int:
        """A random 52-bit number (exact in a float64 gather); rank 0's becomes the checkpoint id."""
        return secrets.randbits(52)


V = TypeVar("V")


def gather_votes(coord: Coordinator, vote: V) -> list[V]:
    """Every rank's ``vote``, indexed by rank, on every rank (one all-gather).

    ``vote`` is a dataclass whose fields are bool, int (exact below 2**53: the values travel as
    float64), int enums or float; each rank gets back instances of the same class.
    """
    names = [f.name for f in dataclasses.fields(vote)]  # type: ignore[arg-type]
    kinds = [type(getattr(vote, n)) for n in names]
    rows = coord.gather([float(getattr(vote, n)) for n in names]).tolist()
    return [
        type(vote)(
            **{
                n: k(int(v)) if issubclass(k, int) else k(v)
                for n, k, v in zip(names, kinds, row, strict=True)
            }
        )
        for row in rows
    ]
