"""Live apply (deck.serve.live) of a real publish URI: a 2-rank DMP DLRM (column-wise tables:
each row's columns joined from two shards) publishes every 2 steps with a full every 8; rank 0
serves float, int8 and fp16 copies of its tables and applies each publish right after it.

- after every switch each served copy is bitwise ``restore(step)`` / TorchRec's quantize of it,
  built from scratch;
- reader threads hammer all three copies during the whole run; every response equals the
  reference response of the version the gate said it read;
- (module fixture's folder) rollback to each kept step without storage reads, further back
  from storage, forward again; a byte-flipped update leaves the served version, logged;
  a capped apply writes the most-requested rows first and paces across versions; a slice's
  copy does not wait for a request in flight on other rows.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from live_helpers import (
    EBC,
    KINDS,
    bitwise_diff,
    collection,
    dense_diff,
    dense_inputs,
    dense_state,
    lookup,
    reference,
    requests,
    score,
    serving_models,
)
from safetensors.torch import load_file, save_file

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.format.manifest import step_dir
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.serve.live import LiveConfig, LiveModel, VersionSwitch
from deck.storage import LocalStorage
from deck.testing.dist_harness import run_ranks
from deck.testing.faulty_storage import FaultyStorage

pytestmark = pytest.mark.slow

SPEC = ModelSpec(num_tables=3, rows=300, dim=16, batch=32, sharding="column_wise")
LAST = 14
PUBLISHED = list(range(0, LAST + 1, 2))


def _hammer(
    live: LiveModel,
    models: dict[str, torch.nn.Module],
    reqs: list[Any],
    stop: threading.Event,
    seed: int,
    out: list[tuple[str, int, int, torch.Tensor, torch.Tensor]],
) -> None:
    rng = random.Random(seed)
    xs = dense_inputs(SPEC)
    while not stop.is_set():
        kind, i = rng.choice(KINDS), rng.randrange(len(reqs))
        # a third of the requests do not say which rows they read: they wait for whole versions
        batch = reqs[i] if rng.random() < 0.67 else None
        with live.serving(batch) as v, torch.no_grad():
            got = lookup(models[kind], reqs[i])
            answer = models[kind](xs[i], reqs[i]).clone()  # tables and dense state
        out.append((kind, i, v.step, got, answer))


def _train_and_serve(rank: int, world_size: int, ckpt: str, pub: str) -> None:
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=ckpt,
        delta_every_steps=7,
        staging=deck.StagingConfig(chunk_bytes=16 * 1024),
        publish=deck.PublishConfig(uri=pub, every_steps=2, full_every_steps=8),
    )
    switches: list[VersionSwitch] = []
    served = serving_models(SPEC) if rank == 0 else {}
    reqs = requests(SPEC)
    answers: list[tuple[str, int, int, torch.Tensor, torch.Tensor]] = []
    dense_at: dict[int, dict[str, torch.Tensor]] = {}  # the trained model's, at each publish
    stop = threading.Event()
    live: LiveModel | None = None
    readers: list[threading.Thread] = []
    try:
        with deck.enable(model, [opt], config) as ck:
            for step in range(0, LAST + 1):
                if step:
                    train_step(model, opt, SPEC, step)
                ck.step(step)
                if step % 2:
                    continue
                assert ck.flush()
                dist.barrier()
                if rank == 0:
                    dense_at[step] = dense_state(model)
                    save_file(dense_at[step], _dense_file(pub, step))
                    if live is None:
                        # small slices: requests interleave with the writes of every version
                        live = LiveModel(
                            list(served.values()),
                            LocalStorage(pub),
                            LiveConfig(slice_rows=16),
                            on_switch=switches.append,
                        )
                        readers = [
                            threading.Thread(
                                target=_hammer,
                                args=(live, served, reqs, stop, s, answers),
                                daemon=True,
                            )
                            for s in range(2)
                        ]
                        for t in readers:
                            t.start()
                    got = live.poll()
                    assert [s.step for s in got] == [step], (step, got)
                    assert live.step == step
                    bad = bitwise_diff(served, reference(pub, step, SPEC))
                    bad += dense_diff(served, dense_at[step])
                    assert not bad, (step, bad[:5])
                dist.barrier()
    finally:
        stop.set()  # a failed check must not leave the readers running
        for t in readers:
            t.join()
    if rank != 0:
        return
    # Every publish became one version: the first and the periodic full of step 8 whole (only
    # the rows that differ written), the others deltas.
    assert [(s.step, s.kind) for s in switches] == [
        (s, "full" if s % 8 == 0 else "delta") for s in PUBLISHED
    ]
    assert all(s.staleness_s is not None and s.staleness_s >= 0 for s in switches)
    assert all(s.rows > 0 for s in switches)
    # No response mixes versions: each equals the reference answer of the version it read, its
    # embeddings and the model's answer from them and the step's dense state.
    refs: dict[int, dict[str, torch.nn.Module]] = {s: reference(pub, s, SPEC) for s in PUBLISHED}
    xs, dlrm = dense_inputs(SPEC), serving_models(SPEC)["float"]
    seen = set()
    for kind, i, step, got, answer in answers:
        if step < 0:
            continue  # before the first version (the serving models' own random tables)
        with torch.no_grad():
            want = refs[step][kind](reqs[i]).values()
        assert torch.equal(got, want), (kind, i, step)
        want = score(dlrm, xs[i], reqs[i], refs[step][kind], dense_at[step])
        assert torch.equal(answer, want), (kind, i, step)
        seen.add(step)
    assert len(answers) > 0 and seen, "the readers never ran"


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("live")
    ckpt, pub = str(tmp / "ckpt"), str(tmp / "pub")
    run_ranks(_train_and_serve, ckpt, pub)
    return pub


def test_each_step_applied_live_is_bitwise_the_restore_and_its_quantisation(
    published: str,
) -> None:
    # (the checks run in rank 0 while training, see _train_and_serve)
    assert sorted(read_manifests(LocalStorage(published))) == PUBLISHED


def _at(pub: str, step: int) -> dict[str, torch.nn.Module]:
    return reference(pub, step, SPEC)


def _dense_file(pub: str, step: int) -> str:
    """Where the trainer kept its dense state at a published step (beside the publish URI)."""
    return f"{pub}-dense-{step}.safetensors"


def _wrong(
    served: dict[str, torch.nn.Module], pub: str, step: int, trained: str | None = None
) -> list[str]:
    """What of the served models (tables and dense state) is not bitwise step ``step`` of
    ``pub`` (a copy of ``trained``, the module fixture's publish URI)."""
    return bitwise_diff(served, _at(pub, step)) + dense_diff(
        served, load_file(_dense_file(trained or pub, step))
    )


def test_rollback_to_kept_steps_in_place_then_from_storage_then_forward(published: str) -> None:
    gets: list[str] = []
    store = FaultyStorage(
        LocalStorage(published), fail_get=lambda key, n: gets.append(key) or False
    )
    served = serving_models(SPEC)
    events: list[VersionSwitch] = []
    live = LiveModel(
        list(served.values()), store, LiveConfig(keep_versions=3), on_switch=events.append
    )
    assert [s.step for s in live.poll()] == [LAST]  # a fresh model: one whole version
    assert not _wrong(served, published, LAST)
    # Back to the periodic full of step 8 (not kept: read from storage), then forward again
    # one delta at a time: 10, 12, 14, each keeping what it replaced.
    switch = live.rollback(8)
    assert switch is not None and switch.kind == "reload" and live.held
    assert not _wrong(served, published, 8)
    assert live.poll() == []  # held
    live.resume()
    assert [(s.step, s.kind) for s in live.poll()] == [
        (10, "delta"),
        (12, "delta"),
        (LAST, "delta"),
    ]
    assert live.kept_steps() == [12, 10, 8]
    # Each kept step in place, reading no rows: only its commit record (the trainer may have
    # saved the step again since)
    for step in (12, 10, 8):
        gets.clear()
        switch = live.rollback(step)
        assert switch is not None and switch.kind == "rollback"
        assert gets == [f"{step_dir(step)}/manifest.json"], gets
        assert live.step == step and not _wrong(served, published, step), step
    # Further back than kept: from storage (the full of step 0 and its deltas).
    switch = live.rollback(4)
    assert switch is not None and switch.kind == "reload" and gets
    assert not _wrong(served, published, 4)
    with pytest.raises(deck.errors.CheckpointNotFoundError, match="rollback goes back"):
        live.rollback(6)
    # Forward again to the newest step.
    live.resume()
    got = live.poll()
    assert got and got[-1].step == LAST
    assert not _wrong(served, published, LAST)


def _flip_a_byte(pub: str, step: int, file: str = "chunk") -> str:
    """Flip a byte of step ``step``'s first chunk (``file="dense"``: of its dense state)."""
    storage = LocalStorage(pub)
    m = read_manifests(storage)[step]
    part = read_rank_manifests(storage, m)[0]
    assert part.dense is not None
    rel = part.shards[0].chunks[0].path if file == "chunk" else part.dense.path
    path = os.path.join(pub, m.folder, rel)
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x40
    Path(path).write_bytes(bytes(data))
    return path


def test_a_poisoned_update_never_reaches_the_served_model(
    published: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pub = str(tmp_path / "pub")
    shutil.copytree(published, pub)
    served = serving_models(SPEC)
    faults: list[Any] = []
    live = LiveModel(list(served.values()), LocalStorage(pub), on_fault=faults.append)
    # Serve step 8 first: the chain of the newest step without its deltas is the full of 8.
    _flip_a_byte(pub, 10)
    with caplog.at_level(logging.ERROR, logger="deck.serve.live"):
        switches = live.poll()
    # Step 10 is damaged: the newest chain that avoids it ends at the full of step 8; 12 and 14
    # build on 10 and are not applied either.
    assert [s.step for s in switches] == [8]
    assert live.step == 8 and not _wrong(served, pub, 8, published)
    assert len(faults) == 1 and faults[0].step == LAST and "checksum" in faults[0].error
    assert "step-000000000010" in faults[0].checkpoint
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "not applied" in errors[0] and "serving step" in errors[0]
    # Polling again tries nothing new: the served version stays, nothing logged again.
    caplog.clear()
    assert live.poll() == [] and live.step == 8
    assert not [r for r in caplog.records if r.levelno == logging.ERROR]


@pytest.mark.parametrize("file", ["chunk", "dense"])
def test_a_poisoned_delta_after_the_served_step_keeps_the_version(
    published: str, tmp_path: Path, file: str
) -> None:
    """Damage in a chunk or in the dense state file: the step is refused whole (its tables
    and its dense state), the served version stays, bitwise."""
    pub = str(tmp_path / "pub")
    shutil.copytree(published, pub)
    served = serving_models(SPEC)
    live = LiveModel(list(served.values()), LocalStorage(pub))
    live.poll()
    live.rollback(10)
    path = _flip_a_byte(pub, 12, file)
    live.resume()
    assert live.poll() == []  # 12 refused, 14 builds on it
    assert live.step == 10 and not _wrong(served, pub, 10, published)
    assert [f.step for f in live.faults] == [12]
    assert "checksum" in live.faults[0].error and os.path.basename(path) in live.faults[0].error


def _tables_only(served: dict[str, torch.nn.Module]) -> list[torch.nn.Module]:
    """The served models' collections alone: versions without dense state, whose rows requests
    may read slice by slice (a version changing the dense state is read whole or not at all)."""
    return [collection(m) for m in served.values()]


def test_a_capped_apply_writes_the_most_requested_rows_first(published: str) -> None:
    served = serving_models(SPEC)
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    live = LiveModel(
        _tables_only(served),
        LocalStorage(published),
        LiveConfig(rows_per_s=100.0, slice_rows=10),
        prefix=EBC,
        clock=lambda: now[0],
        sleep=sleep,
    )
    live.poll()
    live.rollback(12)
    live.resume()
    plan = live.source.next_plans(live.version, frozenset())[0]
    version = live.prepare(plan)
    key = "sparse_arch.embedding_bag_collection.embedding_bags.t1.weight"
    ids = version.tables[key].ids
    hot = ids[-3:]  # requested most
    for _ in range(5):
        with live.serving({key: hot}) as v:
            assert v.step == 12
    applying = live.begin(version)
    assert not applying.step(3)
    # the three hot rows are written (the new version's values), the version not switched yet
    table = collection(served["float"]).embedding_bags["t1"].weight
    new = version.tables[key].new[0]
    assert torch.equal(table.data[hot], new[-3:])
    assert live.step == 12
    # a request on the hot rows reads the new version; one on rows not written yet the old one
    with live.serving({key: hot}) as v:
        assert v.step == LAST
    with live.serving({key: ids[:1]}) as v:
        assert v.step == 12
    # paced: rows_per_s=100 -> the remaining rows take remaining/100 s of (fake) sleep
    rest = applying.remaining
    slept.clear()
    switch = applying.run(10, 100.0, clock=lambda: now[0], sleep=sleep)
    live.finished(applying)
    assert switch.step == LAST and live.step == LAST
    last = rest % 10 or 10  # no wait after the last slice
    assert sum(slept) == pytest.approx((rest - last) / 100.0)
    assert not bitwise_diff(served, _at(published, LAST))


def test_a_request_in_flight_on_other_rows_does_not_hold_up_a_slice(published: str) -> None:
    """A slice's rows are locked while written: the applier waits only for the requests in
    flight that read one of them, not for one on other rows (it reads the old version
    meanwhile); a request on its rows, started during the copy, reads the new version whole."""
    served = serving_models(SPEC)
    live = LiveModel(
        _tables_only(served), LocalStorage(published), LiveConfig(rows_per_s=None), prefix=EBC
    )
    live.poll()
    live.rollback(12)
    live.resume()
    plan = live.source.next_plans(live.version, frozenset())[0]
    version = live.prepare(plan)
    key = "sparse_arch.embedding_bag_collection.embedding_bags.t1.weight"
    ids = version.tables[key].ids
    outside = [r for r in range(SPEC.rows) if r not in set(ids.tolist())][:3]
    inside = ids[:3]
    # failpoint: the float copy's write of the slice stops until `go`
    target = live.tables.by_key[key][0]
    write, in_write, go = target.write, threading.Event(), threading.Event()

    def paused(rows: torch.Tensor, stored: torch.Tensor) -> None:
        in_write.set()
        assert go.wait(60)
        write(rows, stored)

    target.write = paused  # type: ignore[method-assign]
    seen: dict[str, int] = {}
    entered, release = threading.Event(), threading.Event()

    def in_flight() -> None:
        with live.serving({key: outside}) as v:
            seen["outside"] = v.step
            entered.set()
            assert release.wait(60)

    other = threading.Thread(target=in_flight)
    other.start()
    assert entered.wait(60)
    applying = live.begin(version)
    writer = threading.Thread(target=applying.step, args=(version.rows,))  # one slice: all
    writer.start()
    # the copy starts while the request on other rows is still running (before, the applier
    # waited for every request in flight before each slice)
    assert in_write.wait(60), "the slice waited for a request on other rows"
    release.set()
    other.join()
    assert seen["outside"] == 12

    def request() -> None:
        with live.serving({key: inside}) as v:
            seen["inside"] = v.step

    blocked = threading.Thread(target=request)
    blocked.start()
    go.set()
    for t in (writer, blocked):
        t.join()
    assert seen["inside"] == LAST and live.step == LAST
    assert not bitwise_diff(served, _at(published, LAST))


def test_the_cap_paces_across_versions_their_reading_included(published: str) -> None:
    """A capped poll applying two versions waits out the first one's last slice before
    reading the second: rows_per_s bounds the rows written per second across versions."""
    served = serving_models(SPEC)
    now = [0.0]
    log: list[tuple[str, float]] = []

    def sleep(s: float) -> None:
        log.append(("sleep", s))
        now[0] += s

    live = LiveModel(
        _tables_only(served),
        LocalStorage(published),
        LiveConfig(rows_per_s=100.0, slice_rows=10),
        prefix=EBC,
        clock=lambda: now[0],
        sleep=sleep,
    )
    live.poll()
    live.rollback(10)
    live.resume()
    prepare = live.prepare

    def logged(plan: Any) -> Any:
        log.append(("prepare", now[0]))
        return prepare(plan)

    live.prepare = logged  # type: ignore[method-assign]
    log.clear()
    switches = live.poll()
    assert [s.step for s in switches] == [12, LAST]
    first, second = switches[0].rows, switches[1].rows
    starts = [t for what, t in log if what == "prepare"]
    # the second version is read once the first one's rows are due at 100 rows/s
    assert starts[1] == pytest.approx(starts[0] + first / 100.0)
    last = second % 10 or 10  # its own last slice's pause comes before a next version
    assert sum(t for what, t in log if what == "sleep") == pytest.approx(
        (first + second - last) / 100
    )
    assert not bitwise_diff(served, _at(published, LAST))
