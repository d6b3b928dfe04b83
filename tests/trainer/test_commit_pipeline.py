"""Commits pipelined on a slow store: consecutive checkpoints' uploads and commits overlap, and
the ordering rule still holds -- a commit record is put only after every rank part of its
checkpoint and after its parent's record, and a delta of a failed checkpoint is never
committed, while every step committed before it stays restorable.

Real components: SeaweedFS S3 (the session's server) behind a latency proxy (every request pays
a round trip), two ranks of a synthetic job staging through a real Stager each
(deck.testing.staging.StagedSynth), and a store wrapper that records the order of puts and
holds a chosen put until another one has ended (deck.testing.staging.PutOrder): the overlap is
forced, not timed -- a committer that finished one checkpoint before starting the next would
never get there, and the test would fail.
"""

from __future__ import annotations

import errno
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deck.config import StagingConfig
from deck.errors import StorageError
from deck.format.manifest import MANIFEST, rank_manifest_name, step_dir
from deck.read.catalog import read_manifests
from deck.storage import FsspecStorage, Storage, open_storage
from deck.testing.s3_server import SeaweedS3
from deck.testing.slow_store import LatencyProxy, S3Requests
from deck.testing.staging import PutOrder, StagedSynth
from deck.testing.synth import restore_step, same

DELAY_S = 0.01  # each way: a 20 ms round trip
STAGING = StagingConfig(chunk_bytes=4096, retry_initial_s=0.01, retry_max_s=0.05)


@pytest.fixture
def slow_s3(s3_server: SeaweedS3) -> Iterator[Callable[[], Storage]]:
    """Opens a fresh prefix of the session's S3 server, through a latency proxy."""
    with LatencyProxy(s3_server.ports["s3"], DELAY_S) as proxy:
        options = proxy.s3_options(s3_server.storage_options)
        yield lambda: open_storage(s3_server.uri(f"test-{uuid.uuid4().hex[:12]}"), options)


def _record(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"


def _is_part(step: int, rank: int) -> Callable[[str], bool]:
    """Matches the part manifest of rank ``rank`` for ``step`` (whatever the checkpoint id)."""
    return lambda key: (
        key.startswith(f"{step_dir(step)}/") and key.endswith(f"/{rank_manifest_name(rank)}")
    )


def _restores_bitwise(store: Storage, job: StagedSynth, steps: list[int]) -> None:
    for step in steps:
        state, user_step = restore_step(store, step)
        assert user_step == step and not same(state, job.saved[step].state), step


def test_commit_records_follow_their_parts_and_parents_while_checkpoints_overlap(
    tmp_path: Path, slow_s3: Callable[[], Storage]
) -> None:
    """Eight checkpoints staged one after the other without waiting. Step 2's commit record
    is held until both part manifests of step 3 are up (uploads overlap commits); rank 1's
    part manifest of step 5 is held until rank 0's part manifest of step 6 is up (a later
    checkpoint's part is ready before an earlier checkpoint is). Every record still begins
    after its checkpoint's part manifests and its parent's record ended, every checkpoint
    commits, and each step restores bitwise."""
    held: dict[str, bool] = {}

    def hold(key: str) -> None:
        if key == _record(2):
            held[key] = store.wait_ended(_is_part(3, 0)) and store.wait_ended(_is_part(3, 1))
        elif _is_part(5, 1)(key):
            held["part 5"] = store.wait_ended(_is_part(6, 0))

    store = PutOrder(slow_s3(), before_put=hold)
    job = StagedSynth(store, STAGING, str(tmp_path / "spool"))
    try:
        stats = []
        for _ in range(8):
            job.train()
            stats.append(job.stage())
        job.flush()
    finally:
        job.close()

    assert held == {_record(2): True, "part 5": True}, held
    assert [[s.state for s in ranks] for ranks in stats] == [["committed", "uploaded"]] * 8
    steps = [ranks[0].step for ranks in stats]
    ids = {ranks[0].step: ranks[0].id for ranks in stats}
    for before, step in zip([None, *steps], steps, strict=False):
        record = store.at("begin", _record(step))
        for rank in (0, 1):
            folder = f"{step_dir(step)}/{ids[step]}"
            part = store.at("end", f"{folder}/{rank_manifest_name(rank)}")
            assert part < record, (step, rank)
            # ... and every file of the part ended before its part manifest began.
            files = [
                store.at("end", k)
                for k in store.puts()
                if k.startswith(f"{folder}/rank-{rank:05d}/")
            ]
            assert files and max(files) < store.at("begin", f"{folder}/{rank_manifest_name(rank)}")
        if before is not None:
            assert store.at("end", _record(before)) < record, step
    assert sorted(read_manifests(store)) == steps
    _restores_bitwise(store, job, steps)


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failed_upload_mid_burst_commits_nothing_on_top_of_it(
    tmp_path: Path, slow_s3: Callable[[], Storage], failing_rank: int
) -> None:
    """Seven checkpoints staged without waiting (a full, then deltas, each of the one before).
    One rank's upload of step 4's files fails for good (a full disk: not retried), once the
    part manifests of step 6 are up: the later deltas are in flight. Steps 1-3 commit and
    restore bitwise; step 4 and every delta after it never gets a commit record, each failing
    with its parent named as not committed."""
    failed: list[str] = []

    def fail(key: str) -> None:
        if key.startswith(f"{step_dir(4)}/") and f"/rank-{failing_rank:05d}/" in key:
            failed.append(key)
            # The first waits (one upload thread; the others go on), every one fails.
            if len(failed) == 1:
                assert store.wait_ended(_is_part(6, failing_rank))
            raise StorageError(f"injected: could not write {key}") from OSError(
                errno.ENOSPC, "No space left on device"
            )

    store = PutOrder(slow_s3(), before_put=fail)
    job = StagedSynth(store, STAGING, str(tmp_path / "spool"))
    try:
        stats = []
        for _ in range(7):
            job.train()
            stats.append(job.stage())
        job.flush()
    finally:
        job.close()

    assert failed
    rank0 = {s.step: (s.kind, s.state) for s, _ in stats}
    assert rank0 == {
        1: ("full", "committed"),
        2: ("delta", "committed"),
        3: ("delta", "committed"),
        4: ("delta", "failed"),
        5: ("delta", "failed"),
        6: ("delta", "failed"),
        7: ("delta", "failed"),
    }, rank0
    rank1 = {s.step: s.state for _, s in stats}
    assert rank1 == {s: "failed" if s == 4 and failing_rank == 1 else "uploaded" for s in rank1}
    for s, _ in stats[4:]:
        assert s.error is not None and f"delta of step {s.step - 1} " in s.error, s.error
        assert "not committed" in s.error, s.error
    assert not [k for k in store.puts("begin") if k in {_record(s) for s in range(4, 8)}]
    assert sorted(read_manifests(store)) == [1, 2, 3]
    _restores_bitwise(store, job, [1, 2, 3])


def test_a_delta_commit_makes_only_the_requests_it_needs(
    tmp_path: Path, slow_s3: Callable[[], Storage]
) -> None:
    """The requests of a delta whose rank 1 part is up before rank 0 stages its own: each
    rank's files and part manifest, rank 0's one read of rank 1's part manifest, one listing
    of the step's folder (every file the parts name is there, right before the record), the
    commit log's entry and one listing of its catalogs (a catalog made meanwhile may have
    passed the entry's number), the commit record. No stat, no read of the step's own record (a part staged by this process
    cannot be committed yet) nor of the parent's (this process committed it)."""
    store = slow_s3()
    assert isinstance(store, FsspecStorage)
    requests = S3Requests(store.fs)
    job = StagedSynth(store, STAGING, str(tmp_path / "spool"))
    try:
        job.stage("full")
        job.flush()
        job.train()
        requests.clear()
        rank0, rank1 = job.stage(one_by_one=True)
        job.flush()
        counts = requests.taken()
    finally:
        job.close()
    assert (rank0.state, rank1.state) == ("committed", "uploaded")
    objects = store.list(f"{step_dir(rank0.step)}/{rank0.id}/")  # both ranks' files and parts
    assert counts == {"put_object": len(objects) + 2, "get_object": 1, "list_objects_v2": 2}, counts
