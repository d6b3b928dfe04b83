"""Managed-collision (ZCH) collections: TorchRec's ``ManagedCollisionEmbeddingCollection`` and
``ManagedCollisionEmbeddingBagCollection`` with ``MCHManagedCollisionModule`` remappers, sharded
row_wise (the only sharding TorchRec's ``ManagedCollisionCollectionSharder`` offers).

A sharded MC collection holds a sharded EmbeddingCollection / EmbeddingBagCollection (its
tables: ordinary row_wise tables to deck) and one remapper per table on every rank, which maps
the raw ids routed to this rank onto the slots (table rows) of this rank's row shard.

- **Tables.** Their lookups are tracked by forward hooks on the inner collection's lookup
  modules (the MC collection calls its inner ``compute`` itself, which never calls TorchRec's
  tracker callbacks). An eviction resets rows in the forward, before any lookup and whether
  they are looked up or not: the rows it resets are recorded (and guarded for a copy-on-write
  snapshot still copying them) right before the reset, through a wrapper around the
  collection's ``_evict``.
- **Remapping state.** Each remapper's id arrays (raw ids sorted, the slot of each, the eviction
  policy's per-slot metadata), its counters (iteration, last eviction, history size and fill:
  Python attributes, outside any state_dict) and the ids seen since its last eviction (with the
  policy's history metadata: non-persistent) are saved **in full by every checkpoint**, in the
  rank's extra state (``"modules"``). Not as rows that change: an eviction re-sorts the arrays,
  which moves most of their positions at once, and between evictions nothing changes, so a
  delta would carry either everything or nothing. The arrays are 8 bytes x (2 + metadata) per
  slot, one slot per table row of the shard: a few percent of the table and its optimizer state
  (docs/architecture.md has the measured size), plus at most one eviction interval of ids.
- **Restore** puts it back exactly into the same world size and layout; into another world size
  it is refused before anything is written, on every rank: a remapper holds the raw ids that
  TorchRec routes to its rank by a block of the id space, and another world size moves those
  blocks, so no saved remapper is any new rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from deck.adapters.torchrec_compat import (
    mc_collections,
    mc_inner_collection_path,
    mc_remappers,
    mch_layout,
    mch_state,
    set_mch_state,
    wrap_mc_evict,
)
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from deck.errors import CorruptCheckpointError, IncompatibleModelError, UnsupportedError
from deck.model import RemovableHandle, RowRecorder

STATE_KEY = "managed_collision"  # the adapter's entry in its module state


class ManagedCollision:
    """One managed-collision collection of the model: ``path`` (the plan's), the sharded
    ``module``, the path of its inner collection and this rank's remapper of each table.
    :meth:`of` reads them from a sharded collection."""

    def __init__(self, path: str, module: Any, inner_path: str, remappers: dict[str, Any]):
        self.path = path
        self.module = module
        self.inner_path = inner_path
        self.remappers = remappers
        for table, remapper in remappers.items():
            if type(remapper) is not MCHManagedCollisionModule:
                raise UnsupportedError(
                    f"module {path or '(root)'!r}, table {table!r}: its managed-collision module "
                    f"is a {type(remapper).__name__}; deck checkpoints managed-collision "
                    "collections whose remappers are TorchRec's MCHManagedCollisionModule (it "
                    "knows where that one keeps its state, attributes included). A "
                    "HashZchManagedCollisionModule cannot train on CPU (fbgemm's CPU "
                    "zero_collision_hash only looks ids up, it never inserts them), so deck "
                    "cannot test its checkpoints; use MCHManagedCollisionModule, or a plain "
                    "EmbeddingCollection / EmbeddingBagCollection with hashed ids"
                )

    @classmethod
    def of(cls, path: str, module: Any) -> ManagedCollision:
        """The sharded managed-collision collection ``module`` at plan path ``path``."""
        _, mcc = mc_collections(module)
        return cls(path, module, mc_inner_collection_path(path), mc_remappers(mcc))

    def state(self) -> dict[str, Any]:
        """Each remapper's state with its layout (first slot, slots), live."""
        return {
            table: {"layout": list(mch_layout(r)), **mch_state(r)}
            for table, r in sorted(self.remappers.items())
        }

    def track_evictions(self, store: RowRecorder, table_bases: dict[str, int]) -> RemovableHandle:
        """Record into ``store`` the rows each eviction resets (``table_bases``: the tracker
        base of this rank's shard of each table, by table name), before the reset."""

        def before(evictions: dict[str, torch.Tensor | None]) -> None:
            rows = [
                idx.to(torch.int64) + table_bases[table]
                for table, idx in evictions.items()
                if idx is not None and idx.numel() and table in table_bases
            ]
            if not rows:
                return
            positions = torch.cat(rows)
            # Recorded whatever the tracking mode (paused, eval): the rows change all the same.
            if store.guarding:
                store.guard(positions)
            store.record(positions)
            store.compact()

        remove, intact = wrap_mc_evict(self.module, before)
        return RemovableHandle(remove, intact)


def module_state(collections: list[ManagedCollision], world_size: int) -> dict[str, Any]:
    """The adapter's module state: every remapper of every collection, and the world size."""
    if not collections:
        return {}
    return {
        STATE_KEY: {
            "world_size": world_size,
            "collections": {c.path: c.state() for c in collections},
        }
    }


def prepare_restore(
    collections: list[ManagedCollision],
    saved: dict[str, Any],
    saved_ranks: int,
    world_size: int,
    where: str,
) -> Callable[[], None]:
    """Check the saved remappers against the live ones; raises IncompatibleModelError (nothing
    written yet) when they do not fit, CorruptCheckpointError when they are not what
    :func:`module_state` writes, else returns what puts them back."""
    try:
        return _prepare(collections, saved, saved_ranks, world_size, where)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CorruptCheckpointError(
            f"{where}: its managed-collision state is not what deck writes ({type(e).__name__}: "
            f"{e}); the extra state file is damaged"
        ) from e


def _prepare(
    collections: list[ManagedCollision],
    saved: dict[str, Any],
    saved_ranks: int,
    world_size: int,
    where: str,
) -> Callable[[], None]:
    mine = saved.get(STATE_KEY)
    live_paths = sorted(c.path for c in collections)
    if mine is None:
        if collections:
            raise IncompatibleModelError(
                f"{where} holds no managed-collision state, and this model has managed-collision "
                f"collection(s) {live_paths}: it was saved from another model (or by a deck "
                "that refused them); restore it into the model it was saved from"
            )
        return lambda: None
    saved_collections: dict[str, Any] = mine["collections"]
    if sorted(saved_collections) != live_paths:
        raise IncompatibleModelError(
            f"{where} holds managed-collision state of {sorted(saved_collections)}, this model "
            f"has managed-collision collection(s) {live_paths}; restore it into the model it "
            "was saved from"
        )
    if saved_ranks != world_size:
        raise IncompatibleModelError(
            f"{where} was saved by {saved_ranks} ranks and this job has {world_size}: the "
            f"managed-collision collection(s) {live_paths} cannot change world size. Each "
            "rank's MCH remapper holds the raw ids TorchRec routes to that rank (by a block of "
            "the id space) and maps them onto that rank's rows; another world size routes the "
            "ids elsewhere, so no saved remapper is any new rank's. Restore it with "
            f"{saved_ranks} ranks (other tables may be resharded then; these may not)"
        )
    puts: list[tuple[Any, dict[str, Any]]] = []
    for c in collections:
        tables = saved_collections[c.path]
        if sorted(tables) != sorted(c.remappers):
            raise IncompatibleModelError(
                f"{where}: managed-collision collection {c.path!r} has tables "
                f"{sorted(c.remappers)}, the checkpoint {sorted(tables)}"
            )
        for table, remapper in c.remappers.items():
            state = tables[table]
            what = f"{where}: table {table!r} of managed-collision collection {c.path!r}"
            first, slots = mch_layout(remapper)
            layout = tuple(int(x) for x in state["layout"])
            if layout != (first, slots):
                raise IncompatibleModelError(
                    f"{what} was saved with this rank's remapper over rows [{layout[0]}, "
                    f"{layout[0] + layout[1]}), here it is over rows [{first}, {first + slots})"
                    ": restore with the sharding plan it was saved with"
                )
            live_metadata = sorted(mch_state(remapper)["metadata"])
            if sorted(state["metadata"]) != live_metadata:
                raise IncompatibleModelError(
                    f"{what} was saved by an eviction policy keeping "
                    f"{sorted(state['metadata'])} per slot, this model's keeps {live_metadata}: "
                    "restore with the policy it was saved with"
                )
            _check_state(state, slots)
            puts.append((remapper, state))

    def put() -> None:
        for remapper, state in puts:
            set_mch_state(remapper, state)

    return put


def _check_state(state: dict[str, Any], slots: int) -> None:
    """Raise ValueError (turned into CorruptCheckpointError) unless ``state`` has the shapes
    :func:`mch_state` writes for a remapper of ``slots`` slots: per-slot arrays of that length,
    an id history no longer than its saved size."""
    per_slot = [state["sorted_raw_ids"], state["remapped_ids"], *state["metadata"].values()]
    if any(not isinstance(t, torch.Tensor) or t.shape != (slots,) for t in per_slot):
        raise ValueError(f"per-slot arrays are not {slots} long")
    filled, size = int(state["history"].numel()), int(state["input_history_buffer_size"])
    if filled > max(size, 0) or any(
        t.numel() != filled for t in state["history_metadata"].values()
    ):
        raise ValueError(f"an id history of {filled} ids in a buffer of {size}")
