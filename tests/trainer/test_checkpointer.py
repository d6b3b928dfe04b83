"""Acceptance tests of the foundation: real 2-rank gloo TorchRec DMP models, real files."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import deck
from deck.demo import (
    ModelSpec,
    TrainState,
    build_model,
    capture_state,
    diff_states,
    make_batch,
    train_step,
)
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow

CHUNK = 64 * 1024
SMALL = dict(num_tables=4, rows=3000, dim=16, batch=128, pooling=2)
STEPS, EVERY = 40, 5


def touched_by_table(spec: ModelSpec, world_size: int, steps: range) -> dict[str, set[int]]:
    """Brute-force record of every id looked up in ``steps`` (all ranks), per table index."""
    out: dict[str, set[int]] = defaultdict(set)
    for step in steps:
        for r in range(world_size):
            _, kjt, _ = make_batch(spec, step, r)
            for i, key in enumerate(kjt.keys()):
                out[f"t{i}"].update(kjt[key].values().tolist())
    return out


def _train_and_verify(
    rank: int, world_size: int, spec: ModelSpec, uri: str, result: str, options: dict, spool: str
) -> None:
    model, dense_opt = build_model(spec)
    types = {ps.sharding_type for plan in model.plan.plan.values() for ps in plan.values()}
    if spec.sharding:
        assert types == {spec.sharding}, types
    if spec.data_parallel_tables:
        assert "data_parallel" in types, types
    user = TrainState()
    config = deck.DeckConfig(
        uri=uri,
        delta_every_steps=EVERY,
        storage_options=options,
        staging=deck.StagingConfig(chunk_bytes=CHUNK, spool_dir=spool),
    )
    captured: dict[int, dict[str, torch.Tensor]] = {}
    losses: dict[int, float] = {}
    with deck.enable(model, [dense_opt], config, state=user) as ckpt:
        for step in range(0, STEPS + 1):
            if step:
                losses[step] = train_step(model, dense_opt, spec, step)
                user.step, user.losses = step, [*user.losses, losses[step]]
            if ckpt.step(step) is not None:
                captured[step] = capture_state(model, dense_opt, user)
        kinds = [(h.step, h.kind) for h in ckpt.history]
        for key in ckpt.adapter.replicated_tables():  # (saved whole: nothing to mark)
            assert ckpt.mark_rows(key, [0]) == 0  # (a break-it finding: "no embedding table")
        # The wait for chunk buffers is part of the stall (the slowest rank's of each).
        assert all(0 <= h.buffer_wait_s <= h.stall_s for h in ckpt.history), ckpt.history
    assert kinds == [(0, "full")] + [(s, "delta") for s in range(EVERY, STEPS + 1, EVERY)], kinds
    dist.barrier()

    # Every committed step restores bitwise into a fresh model with other initial weights.
    for step in sorted(captured):
        model2, opt2 = build_model(spec, seed=spec.seed + 1000 + step)
        user2 = TrainState()
        with deck.DeltaCheckpointer(model2, [opt2], config, state=user2) as ck2:
            assert ck2.restore(step) == step
        bad = diff_states(captured[step], capture_state(model2, opt2, user2))
        assert not bad, f"rank {rank} step {step}: {len(bad)} entries differ, e.g. {bad[:5]}"

    # Training on from a restore of step 20 gives the losses of the uninterrupted run.
    model3, opt3 = build_model(spec, seed=spec.seed + 7)
    user3 = TrainState()
    with deck.enable(model3, [opt3], config, state=user3) as ck3:
        assert ck3.restore(20) == 20
        assert user3.step == 20
        again = {s: train_step(model3, opt3, spec, s) for s in range(21, 31)}
    assert again == {s: losses[s] for s in range(21, 31)}, (again, losses)

    # The latest (no step given) is the last committed one.
    model4, opt4 = build_model(spec, seed=5)
    with deck.enable(model4, [opt4], config) as ck4:
        assert ck4.restore() == STEPS
    if rank == 0:
        with open(result, "w") as f:
            json.dump({"losses": losses}, f)


SPECS = {
    "ebc-planner": ModelSpec(**SMALL),
    "ebc-column_wise": ModelSpec(**SMALL, sharding="column_wise"),
    "ebc-table_column_wise": ModelSpec(**SMALL, sharding="table_column_wise"),
    "ec-table_wise": ModelSpec(**SMALL, collection="ec", sharding="table_wise"),
    "ebc-dp-table-adam": ModelSpec(**SMALL, data_parallel_tables=(1,), dense_optimizer="adam"),
}


@pytest.mark.parametrize("name", [*sorted(SPECS), "s3-ebc-planner"])
def test_every_committed_step_restores_bitwise(
    tmp_path: Path, name: str, request: pytest.FixtureRequest
) -> None:
    """Local tier for every model variant; SeaweedFS S3 (spool + upload) for one."""
    spec = SPECS[name.removeprefix("s3-")]
    uri, options = str(tmp_path / "ckpt"), {}
    if name.startswith("s3-"):
        server = request.getfixturevalue("s3_server")
        uri, options = server.uri(f"{tmp_path.name}/ckpt"), server.storage_options
    run_ranks(
        _train_and_verify,
        spec,
        uri,
        str(tmp_path / "result.json"),
        options,
        str(tmp_path / "spool"),
    )
    if name.startswith("s3-"):
        # Everything was uploaded and the spool cleaned up behind it.
        assert not [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]

    # Delta contents: exactly the rows looked up since the parent, per table and column shard.
    storage = open_storage(uri, options)
    manifests = read_manifests(storage)
    assert sorted(manifests) == list(range(0, STEPS + 1, EVERY))
    full_chunk_bytes = sum(
        c.nbytes
        for p in read_rank_manifests(storage, manifests[0])
        for r in p.shards
        for c in r.chunks
    )
    for step, m in manifests.items():
        if m.kind.value == "full":
            continue
        expected = touched_by_table(spec, 2, range(m.parent + 1, step + 1))
        saved: dict[tuple[str, int], set[int]] = defaultdict(set)
        payload = data = nchunks = 0
        for part in read_rank_manifests(storage, m):
            for rec in part.shards:
                table = rec.table.split(".")[-2]
                row_bytes = 8 + sum(
                    s.nbytes // max(1, s.shape[0])
                    for s in (rec.chunks[0].segments[1:] if rec.chunks else ())
                )
                # Every chunk but a shard's last is exactly the configured size.
                assert all(c.nbytes == CHUNK for c in rec.chunks[:-1])
                assert all(c.nbytes <= CHUNK and c.nbytes % 4096 == 0 for c in rec.chunks)
                for c in rec.chunks:
                    ids = torch.frombuffer(
                        bytearray(storage.get(f"step-{step:012d}/{c.path}")),
                        dtype=torch.int64,
                        count=c.rows,
                    )
                    saved[(table, rec.col_offset)].update(ids.tolist())
                    payload += c.rows * row_bytes
                    data += c.nbytes
                    nchunks += 1
        for (table, _col), ids in saved.items():
            assert ids == expected[table], (
                f"step {step} {table}: saved {len(ids)} rows, touched {len(expected[table])}"
            )
        if spec.data_parallel_tables:
            assert not any(t == "t1" for t, _ in saved)  # DP table travels with the dense state
        # Close to touched rows x row bytes: only page padding and 64-byte alignment on top.
        assert payload <= data <= payload * 1.02 + nchunks * (4096 + 64 * 4)
        assert data < full_chunk_bytes / 2


def _errors(rank: int, world_size: int, root: str) -> None:
    spec = ModelSpec(**SMALL)
    model, opt = build_model(spec)
    good = os.path.join(root, "good")
    config = deck.DeckConfig(uri=good, delta_every_steps=1)
    with deck.enable(model, [opt], config) as ck:
        ck.save("full", step=0)
        train_step(model, opt, spec, 1)
        ck.step(1)

    # A step folder whose manifest is missing is not a checkpoint; the commit log announced
    # its record, so a plain restore of the latest refuses to pass it by
    if rank == 0:
        os.remove(os.path.join(good, "step-000000000001", "manifest.json"))
    dist.barrier()
    assert [c.step for c in deck.list_checkpoints(good)] == [0]
    with deck.enable(model, [opt], config) as ck:
        with pytest.raises(deck.errors.CorruptCheckpointError, match=r"step 1 .*announced"):
            ck.restore()
        assert ck.restore(allow_fallback=True) == 0
        with pytest.raises(deck.errors.CheckpointNotFoundError, match="step 1"):
            ck.restore(1)

    # An empty URI restores nothing.
    with deck.enable(model, [opt], deck.DeckConfig(uri=os.path.join(root, "empty"))) as ck:
        assert ck.restore() is None

    # Different table shapes: a typed error naming the table.
    other, other_opt = build_model(ModelSpec(**{**SMALL, "rows": 3001}))
    with (
        deck.enable(other, [other_opt], config) as ck,
        pytest.raises(deck.errors.IncompatibleModelError, match=r"t0\.weight"),
    ):
        ck.restore(0)

    # An unwritable URI fails at construction and names it.
    bad = os.path.join(root, "a-file", "ckpt")
    if rank == 0:
        Path(root, "a-file").write_text("not a directory")
    dist.barrier()
    with pytest.raises(deck.errors.StorageError, match="a-file"):
        deck.enable(model, [opt], deck.DeckConfig(uri=bad))


def test_invisible_partial_incompatible_and_unwritable(tmp_path: Path) -> None:
    run_ranks(_errors, str(tmp_path))
