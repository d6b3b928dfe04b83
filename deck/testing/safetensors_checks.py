"""Checks shared by the export and follow tests: a safetensors file holding a model unsharded."""

from __future__ import annotations

from typing import Any

import torch


def assert_holds_model(f: Any, model: Any, tag: tuple[object, ...]) -> None:
    """Every local table shard, fused optimizer state shard and dense parameter of the live
    (sharded) ``model`` equals its slice of the open safetensors file ``f`` (``model.<key>``,
    ``optim.state.<key>.<state>``), bitwise; ``tag`` prefixes each failure message."""
    for key, value in model.state_dict().items():
        full = f.get_tensor(f"model.{key}")
        if hasattr(value, "local_shards"):
            for s in value.local_shards():
                r0, c0 = s.metadata.shard_offsets
                rows, cols = s.metadata.shard_sizes
                got = full[r0 : r0 + rows, c0 : c0 + cols]
                assert torch.equal(got.view(torch.uint8), s.tensor.view(torch.uint8)), (*tag, key)
        else:
            assert torch.equal(full, value), (*tag, key)
    for key, states in model.fused_optimizer.state_dict()["state"].items():
        for name, st in states.items():
            full = f.get_tensor(f"optim.state.{key}.{name}")
            assert tuple(full.shape) == tuple(st.size()), (*tag, key, name)
            for s in st.local_shards():
                sl = tuple(
                    slice(o, o + n)
                    for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes, strict=True)
                )
                assert torch.equal(full[sl], s.tensor), (*tag, key, name)
