"""The test-only CPU kernel of ``fbgemm::reset_weight_momentum`` (deck.testing.fbgemm_cpu),
driven through fbgemm's own caller (``reset_embedding_weight_momentum`` of a CPU TBE with
rowwise Adagrad, as TorchRec's eviction calls it), against the CUDA kernel's semantics written
out here: for each entry ``t`` of ``buffer_ids``, the rows listed for buffer ``buffer_ids[t]``
of table ``logical_table_ids[t]`` get momentum 0 and weights 0; nothing else changes."""

from __future__ import annotations

import pytest
import torch

from deck.testing.fbgemm_cpu import enable_cpu_eviction

DIMS, ROWS = (8, 4, 12), (5, 4, 3)


def _tbe() -> torch.nn.Module:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [
            (r, d, EmbeddingLocation.HOST, ComputeDevice.CPU)
            for r, d in zip(ROWS, DIMS, strict=True)
        ],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    )
    with torch.no_grad():  # every weight and momentum nonzero and distinct
        tbe.weights_host.copy_(torch.arange(1, tbe.weights_host.numel() + 1, dtype=torch.float32))
        tbe.momentum1_host.copy_(torch.arange(1, tbe.momentum1_host.numel() + 1) * 0.5)
    return tbe


def _tables(tbe: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    weights = [w.clone() for w in tbe.split_embedding_weights()]  # type: ignore[operator]
    momentum = [s[0].clone() for s in tbe.split_optimizer_states()]  # type: ignore[operator]
    return weights, momentum


@pytest.mark.parametrize(
    ("indices", "offsets", "tables", "buffers"),
    [
        ([1, 3, 0, 2, 2], [0, 2, 4, 5], [0, 1, 2], [0, 1, 2]),  # one buffer per table
        ([2, 0, 1], [0, 1, 3], [2, 0], [1, 0]),  # buffers reordered: table 2 <- rows [0, 1]
        ([4, 4, 0], [0, 0, 3], [1, 0], [0, 1]),  # an empty buffer; a row listed twice
    ],
)
def test_reset_matches_the_cuda_kernel(
    indices: list[int], offsets: list[int], tables: list[int], buffers: list[int]
) -> None:
    tbe = _tbe()
    enable_cpu_eviction(tbe)
    weights, momentum = _tables(tbe)
    for table, b in zip(tables, buffers, strict=True):  # the CUDA kernel, table by table
        rows = torch.tensor(indices[offsets[b] : offsets[b + 1]], dtype=torch.int64)
        momentum[table][rows] = 0
        weights[table][rows, : DIMS[table] // 4 * 4] = 0
    tbe.reset_embedding_weight_momentum(  # type: ignore[operator]
        pruned_indices=torch.tensor(indices, dtype=torch.int64),
        pruned_indices_offsets=torch.tensor(offsets, dtype=torch.int64),
        logical_table_ids=torch.tensor(tables, dtype=torch.int32),
        buffer_ids=torch.tensor(buffers, dtype=torch.int32),
    )
    got_w, got_m = _tables(tbe)
    for t in range(len(DIMS)):
        assert torch.equal(got_w[t], weights[t]), (t, got_w[t], weights[t])
        assert torch.equal(got_m[t], momentum[t]), (t, got_m[t], momentum[t])


def test_a_tbe_it_was_not_given_is_refused() -> None:
    enable_cpu_eviction()  # the kernel, without this TBE
    tbe = _tbe()
    with pytest.raises(NotImplementedError, match="enable_cpu_eviction"):
        tbe.reset_embedding_weight_momentum(  # type: ignore[operator]
            pruned_indices=torch.tensor([0]),
            pruned_indices_offsets=torch.tensor([0, 1]),
            logical_table_ids=torch.tensor([0], dtype=torch.int32),
            buffer_ids=torch.tensor([0], dtype=torch.int32),
        )
