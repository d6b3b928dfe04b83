"""Export the full state of one step to standard formats: a torch.distributed.checkpoint (DCP)
directory that ``dcp.load`` restores into a freshly built DMP model, or one safetensors file of
unsharded tensors for inspection.

The state of step N is what ``DeltaCheckpointer.restore(N)`` loads: the rows of its cheapest
chain (full, then deltas / merged deltas, newest row wins; :func:`deck.read.restore.apply_chain` does
the applying, with every chunk checksum-verified), the dense state and the dense optimizer state
of the trainer checkpoint of N.

**Names.** Tensors get the names a DCP save of this state dict of the live model would give::

    {"model": model.state_dict(),
     "optim": CombinedOptimizer([model.fused_optimizer, dense_optimizer]).state_dict()}

i.e. ``model.<state_dict key>`` for tables, dense parameters and buffers, and
``optim.state.<param key>.<state>`` for the fused table states (``<table key>.<table name>.
momentum1``, laid out as TorchRec's fused optimizer lays them out: a row-wise state of a
column-sharded table has one block of rows per column shard, in column order) and for the dense
optimizer's (a TorchRec ``KeyedOptimizer``: keyed by parameter name). A dense optimizer whose
state is not keyed by parameter name (a plain ``torch.optim`` one) is left out and reported, as
are non-tensor values and the user's own state (neither can be written without pickle on our
side).

**Memory.** Tables are read and written one *table shard* at a time (every state of one
column/row shard, e.g. 2 x 1M x 64 floats for rowwise Adagrad): the DCP export holds at most the
largest shard plus the dense state; the safetensors export holds the largest *table* (its
tensors must be contiguous) plus the dense state. Each table shard is written to its own
``.distcp`` file; the writer (:mod:`.dcp_writer`) holds one tensor at a time.

DCP's own format pickles its ``.metadata`` file and ``torch.save``-s each tensor (its reader
uses ``weights_only`` loading); deck writes it through DCP's public ``StorageWriter`` interface and never reads it back.

**Modules.** :mod:`.layout` (which shards a step has and where each state goes: ``StepState``),
:mod:`.dense` (the dense and scalar state, DCP's names), :mod:`.run` (the report every export
fills), :mod:`.dcp` and :mod:`.dcp_writer` (the DCP export), :mod:`.safetensors_file` (the
safetensors export, written through :mod:`deck.format.safetensors`). This package re-exports what the CLI and the other ops import.
"""

from deck.ops.export.dcp import export_dcp
from deck.ops.export.dense import eager_state, flatten, table_name
from deck.ops.export.layout import Piece, ShardGeometry, ShardSpec, StepState, geometry_of
from deck.ops.export.run import ExportReport, ExportRun, Progress, check_out_dir
from deck.ops.export.safetensors_file import export_safetensors

__all__ = [
    "ExportReport",
    "ExportRun",
    "Piece",
    "Progress",
    "ShardGeometry",
    "ShardSpec",
    "StepState",
    "check_out_dir",
    "eager_state",
    "export_dcp",
    "export_safetensors",
    "flatten",
    "geometry_of",
    "table_name",
]
