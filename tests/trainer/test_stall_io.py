"""A checkpoint's stall issues no storage request: whether the parent's chain is broken by a
quarantine is learned in the background after a commit (rank 0's lineage check) and handed to
the next checkpoint in memory. Two gloo ranks, a real TorchRec DMP model, every request counted
by a recording wrapper around a real store: local files and a SeaweedFS S3 server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import pytest
import torch.distributed as dist

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.read.catalog import quarantine, read_manifests
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks
from deck.testing.recording_storage import Call, RecordingStorage

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")
# Threads that work on a part once the ranks' vote handed it on, at the very end of the stall:
# a commit (its rank manifest, record and reads), a spool write or an upload of the checkpoint
# just taken may begin before save() has returned, the sooner the busier the machine (a fresh
# clone's suite failed on rank 1 so, with only the commit and upload threads listed here).
HANDED_ON = ("deck-commit", "deck-upload", "deck-part", "deck-record", "deck-read", "deck-spool")
LINEAGE = "deck-lineage-checkpoint"


def _job(rank: int, world_size: int, uri: str, options: dict[str, Any], spool: str) -> None:
    store = RecordingStorage(open_storage(uri, options))
    config = deck.DeckConfig(
        uri=uri,
        storage_options=options,
        delta_every_steps=1,
        lease_ttl_s=None,
        staging=deck.StagingConfig(spool_dir=f"{spool}/{rank}"),
    )
    model, opt = build_model(SPEC)
    kinds: dict[int, str] = {}
    in_stall: dict[int, list[Call]] = {}

    def take(step: int, kind: Literal["delta", "full"] = "delta") -> None:
        train_step(model, opt, SPEC, step)
        # Nothing in flight and every commit's lineage check done: the stall the finding
        # measured (the old code listed quarantine/ exactly then)
        assert ck.flush()
        start = time.perf_counter()
        stats = ck.save(kind, step=step)
        end = time.perf_counter()
        assert stats is not None
        kinds[step] = stats.kind
        in_stall[step] = [
            c for c in store.between(start, end) if not c.thread.startswith(HANDED_ON)
        ]

    def quarantine_step(step: int) -> None:
        """What another process (a merger, `deck verify --quarantine`) does: rank 0 writes the
        record, without this trainer knowing; after the checks of every commit so far."""
        assert ck.flush()
        if rank == 0:
            plain = open_storage(uri, options)
            quarantine(plain, read_manifests(plain)[step], "damaged (test)")
        dist.barrier()

    with deck.DeltaCheckpointer(model, [opt], config, storage=store) as ck:
        take(0, "full")
        take(1)
        take(2)  # no quarantine record
        take(3, "full")  # a new chain: steps 0-2 are on no chain of what follows
        take(4)
        quarantine_step(1)  # on no live chain
        mark = len(store.calls)
        take(5)
        take(6)  # the check after 5's commit read the record, and only it
        assert ck.flush()
        off_chain = [c for c in store.calls[mark:] if c.thread == LINEAGE]
        quarantine_step(4)  # on the live chain: 4, 5, 6 and the next delta are unrestorable
        take(7)  # learned by the check after this one commits
        take(8)
        take(9)
        assert ck.flush()
        lineage = [c for c in store.calls if c.thread == LINEAGE]

    # Every checkpoint's stall, fulls included: no request from the training thread, nor from
    # any thread it could wait for (the old code listed quarantine/ on deck-aside)
    stalled = {s: c for s, c in in_stall.items() if c}
    assert stalled == {}, f"rank {rank}: {stalled}"
    assert kinds == {
        0: "full",
        1: "delta",
        2: "delta",
        3: "full",
        4: "delta",
        5: "delta",  # the quarantined step 1 is on no chain of it
        6: "delta",
        7: "delta",  # the quarantine of step 4 is not known yet: storage is not asked in the stall
        8: "full",  # the check after 7 found its chain broken
        9: "delta",
    }, f"rank {rank}: {kinds}"
    if rank != 0:
        assert lineage == []  # only rank 0 checks; the vote tells the others
        return
    # An off-chain quarantine: the listing, its record once, and not one commit record
    assert [(c.op, c.path.split("/")[0]) for c in off_chain] == [
        ("list", "quarantine"),
        ("get_or_none", "quarantine"),
        ("list", "quarantine"),
    ], off_chain
    # One on the chain: the lineage is read (it could be covered by a merged checkpoint)
    assert any(c.path.endswith("/manifest.json") for c in lineage), lineage


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_stall_issues_no_storage_request(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """Fulls and deltas, with no quarantine record, with one of a step on no live chain (the
    deltas go on, and the lineage check reads that record only) and with one on the live chain
    (learned after the next commit, then a full): zero requests from any stall on every rank."""
    uri, options = str(tmp_path / "ck"), {}
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        uri, options = server.uri(f"{tmp_path.name}/ck"), server.storage_options
    run_ranks(_job, uri, options, str(tmp_path / "spool"))
