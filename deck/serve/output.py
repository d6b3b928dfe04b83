"""What a follower writes besides its held state (``state.safetensors``, which every follower
keeps): an :class:`Output` is told of each state it materialises and of each checkpoint it
applies onto the held state, one at a time. ``deck follow --format parquet`` adds
:class:`deck.serve.parquet_output.ParquetOutput`; another output (a feature store, a queue) is
one class with these two methods."""

from __future__ import annotations

from typing import Any, Protocol

from deck.format.manifest import CheckpointManifest, RankManifest


class Output(Protocol):
    """An output of a :class:`~deck.serve.follow.Follower`, called before the held state is
    replaced (so a crash in between re-does the step: an output replaces what it wrote for a
    step it is given again)."""

    # ``follower`` is the :class:`~deck.serve.follow.Follower` (typed Any: it imports this
    # module, and the seam between them is this Protocol, not an import back)
    def full(self, follower: Any) -> object:
        """The follower just materialised ``follower.state`` (tables in ``follower.tensors``)."""
        ...

    def delta(
        self,
        follower: Any,
        m: CheckpointManifest,
        parent: tuple[int, str] | None,
        parts: list[RankManifest],
    ) -> object:
        """Checkpoint ``m`` (its rank manifests ``parts``) was just applied onto ``parent``:
        ``follower.tensors`` now hold its values."""
        ...

    # Optional: ``holds(state) -> bool``, whether the output already holds ``state`` (step,
    # checkpoint id). A follower resumed from an output directory asks it before its first
    # delta; one that says no is given the held state in full (``full``) first, so it never
    # gets deltas on a base it lacks (e.g. a directory an earlier run wrote without it).


def parquet_outputs(parquet: bool, out_dir: str, uri: str) -> list[Output]:
    """The outputs ``deck follow --format parquet`` asks for (none without it; pyarrow is
    imported only when Parquet is)."""
    if not parquet:
        return []
    from deck.serve.parquet_output import ParquetOutput

    return [ParquetOutput(out_dir, uri)]
