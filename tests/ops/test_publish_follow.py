"""The publisher tenant (DeckConfig.publish) and the loading service (`deck follow`), on a real
2-rank DMP run: the publish chain restores bitwise at every published step, the checkpoint chain
is untouched, and `deck follow --once` (the real console script) reproduces the live tables after
each catch-up, the later ones by applying only the new deltas."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import deck
from deck.demo import ModelSpec, build_model, capture_state, diff_states, train_step
from deck.errors import IncompatibleModelError
from deck.testing.dist_harness import run_ranks
from deck.testing.safetensors_checks import assert_holds_model

pytestmark = pytest.mark.slow
# Column-wise tables (row-wise optimizer state in TorchRec's per-column-shard layout) and a
# data-parallel table (dense state).
SPEC = ModelSpec(
    num_tables=3, rows=300, dim=16, batch=32, sharding="column_wise", data_parallel_tables=(2,)
)
LAST = 14
# First a full materialisation of the chain 0, 2, 4; then a catch-up after each later delta
# (one new delta each), and one after three deltas.
FOLLOW_AT = (4, 6, 8, LAST)


def _deck(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def _check_follow_output(model: object, rank: int, out: str, step: int) -> None:
    """Every local table shard, fused optimizer state shard and dense parameter of the live
    model equals its slice of the follower's file, bitwise."""
    with open(os.path.join(out, "state.json")) as f:
        assert json.load(f)["step"] == step
    with safe_open(os.path.join(out, "state.safetensors"), "pt") as f:
        assert f.metadata()["step"] == str(step)
        assert_holds_model(f, model, (rank, step))


def _check_restores(
    rank: int, uri: str, steps: Iterable[int], live: dict[int, dict[str, torch.Tensor]]
) -> None:
    """Each of ``steps`` loads from ``uri`` into a fresh model bitwise-equal to ``live`` (read
    only: a publish URI is refused as a trainer's checkpoint URI)."""
    fresh, fresh_opt = build_model(SPEC, seed=99)
    for step in steps:
        assert deck.load(fresh, [fresh_opt], uri, step=step) == step
        bad = diff_states(live[step], capture_state(fresh, fresh_opt))
        assert not bad, f"rank {rank}: {uri} step {step}: {bad[:5]}"


def _run(rank: int, world_size: int, ckpt: str, pub: str, out: str, log: str) -> None:
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=ckpt,
        delta_every_steps=6,
        staging=deck.StagingConfig(chunk_bytes=16 * 1024),
        # A periodic publish full at 8, between the follower's reads, on its own schedule
        publish=deck.PublishConfig(uri=pub, every_steps=2, full_every_steps=8),
    )
    live: dict[int, dict[str, torch.Tensor]] = {}
    with deck.enable(model, [opt], config) as ck:
        for step in range(0, LAST + 1):
            if step:
                train_step(model, opt, SPEC, step)
            ck.step(step)
            if step % 2 == 0:
                live[step] = capture_state(model, opt)
            if step in FOLLOW_AT:
                assert ck.flush()
                if rank == 0:
                    r = _deck("follow", pub, "--out", out, "--once")
                    assert r.returncode == 0, r.stdout + r.stderr
                    with open(log, "a") as f:
                        f.write(r.stdout)
                dist.barrier()
                _check_follow_output(model, rank, out, step)
                dist.barrier()
        assert [s.step for s in ck.published] == list(range(0, LAST + 1, 2))
        assert [s.kind for s in ck.published] == [
            "full" if s % 8 == 0 else "delta" for s in range(0, LAST + 1, 2)
        ]
        assert [(s.step, s.kind) for s in ck.history] == [(0, "full"), (6, "delta"), (12, "delta")]

    # Every published step restores bitwise from the publish URI; every checkpoint from the
    # checkpoint URI (its chain is what it would be without a publisher).
    for uri, steps in ((pub, range(0, LAST + 1, 2)), (ckpt, (0, 6, 12))):
        _check_restores(rank, uri, steps, live)


def test_publish_chain_and_follow(tmp_path: Path) -> None:
    ckpt, pub = str(tmp_path / "ckpt"), str(tmp_path / "pub")
    out, log = str(tmp_path / "serving"), str(tmp_path / "follow.log")
    run_ranks(_run, ckpt, pub, out, log)

    # The publish URI is an ordinary deck chain: `deck ls` lists a full every 8 steps and deltas
    # every 2 steps between.
    r = _deck("ls", pub, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert sorted((x["step"], x["kind"]) for x in rows) == [
        (s, "full" if s % 8 == 0 else "delta") for s in range(0, LAST + 1, 2)
    ]

    # The first follow materialised the chain 0, 2, 4; the later ones read only what is new: a
    # delta, the periodic full of step 8 alone, then the deltas after it.
    lines = Path(log).read_text().splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith("step 4 ") and ": full, 3 checkpoint(s)" in lines[0]
    assert lines[1].startswith("step 6 ") and ": delta, 1 checkpoint(s)" in lines[1], lines[1]
    assert lines[2].startswith("step 8 ") and ": full, 1 checkpoint(s)" in lines[2], lines[2]
    assert lines[3].startswith("step 14 ") and ": delta, 3 checkpoint(s)" in lines[3], lines[3]

    # The follower's file holds exactly what `deck export --format safetensors` of the step
    # gives: every table, fused and dense optimizer state and dense tensor, bitwise.
    exp = tmp_path / "export.safetensors"
    r = _deck("export", pub, "--step", str(LAST), "--out", str(exp), "--format", "safetensors")
    assert r.returncode == 0, r.stdout + r.stderr
    with (
        safe_open(str(exp), "pt") as want,
        safe_open(os.path.join(out, "state.safetensors"), "pt") as got,
    ):
        assert set(want.keys()) == set(got.keys())
        for k in want.keys():  # noqa: SIM118 (safe_open is not a mapping)
            a, b = want.get_tensor(k), got.get_tensor(k)
            assert a.dtype == b.dtype and a.shape == b.shape, k
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k

    # Nothing new: a catch-up writes nothing and says nothing.
    r = _deck("follow", pub, "--out", out, "--once")
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


def _failing_publish(rank: int, world_size: int, ckpt: str, pub: str, spool: str) -> None:
    from deck.storage import LocalStorage
    from deck.testing.faulty_storage import FaultyStorage

    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=ckpt,
        delta_every_steps=3,
        staging=deck.StagingConfig(
            chunk_bytes=16 * 1024,
            spool_dir=spool,
            retry_initial_s=0.01,
            retry_max_s=0.02,
            upload_timeout_s=0.2,
        ),
        publish=deck.PublishConfig(uri=pub, every_steps=2),
    )
    # Every upload of the publish of step 4 fails (a remote store: staged in a spool, uploaded
    # in the background), so the failure reaches the checkpointer after step() returned.
    store = FaultyStorage(
        LocalStorage(pub), fail_put=lambda key, n: key.startswith("step-000000000004")
    )
    live: dict[int, dict[str, torch.Tensor]] = {}
    with deck.DeltaCheckpointer(model, [opt], config, publish_storage=store) as ck:
        for step in range(0, 9):
            if step:
                train_step(model, opt, SPEC, step)
            ck.step(step)
            live[step] = capture_state(model, opt)
            if step == 4:
                assert ck.flush()  # the failed upload is given up on (not raised)
                assert ck.published[-1].state == "failed"
        assert [(s.step, s.kind) for s in ck.published] == [
            (0, "full"),
            (2, "delta"),
            (4, "delta"),
            (6, "full"),  # after the failed publish
            (8, "delta"),
        ]
        assert [(s.step, s.kind) for s in ck.history] == [(0, "full"), (3, "delta"), (6, "delta")]
    for uri, steps in ((pub, (2, 6, 8)), (ckpt, (3, 6))):
        _check_restores(rank, uri, steps, live)


def test_failed_publish_leaves_checkpoints_alone(tmp_path: Path) -> None:
    """A publish whose upload fails is logged, not raised; the next publish is a full and the
    checkpoint chain (written at the same time) restores bitwise."""
    run_ranks(
        _failing_publish, str(tmp_path / "ckpt"), str(tmp_path / "pub"), str(tmp_path / "spool")
    )
    r = _deck("ls", str(tmp_path / "pub"), "--json")
    committed = sorted(
        (x["step"], x["kind"]) for x in json.loads(r.stdout) if x["state"] == "committed"
    )
    assert committed == [(0, "full"), (2, "delta"), (6, "full"), (8, "delta")]


def _quantized_publish(rank: int, world_size: int, ckpt: str, pub: str, out: str) -> None:
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=ckpt,
        delta_every_steps=4,
        staging=deck.StagingConfig(chunk_bytes=16 * 1024),
        publish=deck.PublishConfig(uri=pub, every_steps=2, quantize="int8"),
    )
    with deck.enable(model, [opt], config) as ck:
        for step in range(0, 7):
            if step:
                train_step(model, opt, SPEC, step)
            ck.step(step)
            if step == 4:
                at4 = capture_state(model, opt)
        assert ck.flush()
    if rank == 0:
        # The loading service refuses quantised weights unless asked, then says what it holds.
        r = _deck("follow", pub, "--out", out, "--once")
        assert r.returncode == 2 and "--allow-quantized" in r.stderr, r.stdout + r.stderr
        r = _deck("follow", pub, "--out", out, "--once", "--allow-quantized")
        assert r.returncode == 0, r.stdout + r.stderr
        with open(os.path.join(out, "state.json")) as f:
            meta = json.load(f)
        assert meta["step"] == 6 and meta["quantized"] == ["int8"], meta
        # deck export has no opt-in: its refusal points at the exact checkpoint URI (it named
        # the follower's flag as if export took it: a break-it finding)
        r = _deck("export", pub, "--out", f"{out}-export", "--format", "safetensors")
        assert r.returncode == 2 and "export the checkpoint URI" in r.stderr, r.stderr
    dist.barrier()
    with safe_open(os.path.join(out, "state.safetensors"), "pt") as f:
        for key, value in model.state_dict().items():
            if not hasattr(value, "local_shards"):
                continue
            full = f.get_tensor(f"model.{key}")
            for s in value.local_shards():
                r0, c0 = s.metadata.shard_offsets
                rows, cols = s.metadata.shard_sizes
                got, want = full[r0 : r0 + rows, c0 : c0 + cols], s.tensor
                # int8 with a per-row scale: within absmax(row) / 254 (+ fp32 rounding).
                bound = want.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-5) + 1e-7
                assert bool(((got - want).abs() <= bound).all()), (rank, key)
                assert not torch.equal(got, want)  # really quantised
    # The checkpoint chain stays exact (it restores bitwise); a plain restore of the publish
    # chain is refused, naming the opt-in.
    fresh, fresh_opt = build_model(SPEC, seed=5)
    plain = deck.DeckConfig(uri=ckpt, lease_ttl_s=None)
    with deck.DeltaCheckpointer(fresh, [fresh_opt], plain) as rc:
        assert rc.restore() == 4
    assert not diff_states(at4, capture_state(fresh, fresh_opt))
    with pytest.raises(IncompatibleModelError, match="allow_quantized"):
        deck.load(fresh, [fresh_opt], pub, step=6)


def test_quantized_publish_needs_opt_in(tmp_path: Path) -> None:
    ckpt, pub, out = str(tmp_path / "ckpt"), str(tmp_path / "pub"), str(tmp_path / "serving")
    run_ranks(_quantized_publish, ckpt, pub, out)
