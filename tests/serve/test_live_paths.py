"""Live apply (deck.serve.live) on the paths beside the main run of test_live_apply.py:

- a foreign update (another model's full committed later in the same publish URI) is refused
  whole: the served version and every served byte unchanged, one ERROR line, a ``LiveFault``;
- an out-of-order update (the served step's folder deleted: the source offers an older step,
  a delta whose parent is not the served version) likewise;
- an ``EmbeddingCollection`` model (float and TorchRec's int8 quantisation) served live, each
  version bitwise ``restore(step)`` / the quantisation of it;
- the background applier (``start``/``stop``): outcomes decided by the switch events it
  reports, never by a sleep; a store that fails a poll is logged and polled again;
- a URI with nothing published (a typo) is one WARNING naming it; rollback before any version
  or to a step that is not there says why, naming the served and kept steps.

One 2-rank job writes the publish URIs: an EC model publishing every 2 steps, and a model with
other table shapes publishing a full at a later step into a copy of a DLRM's publish URI.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from live_helpers import bitwise_diff, reference, serving_models, state_diff, until

import deck
from deck.demo import ModelSpec, build_model, make_batch, train_step
from deck.errors import CheckpointNotFoundError, ConfigError, UnsupportedError
from deck.format.manifest import step_dir
from deck.model import TableShard
from deck.read.catalog import read_manifests
from deck.read.lineage import cheapest_chain, lineage_graph
from deck.read.restore import apply_chain
from deck.serve.live import LiveConfig, LiveFault, LiveModel, VersionSwitch
from deck.storage import LocalStorage
from deck.testing.dist_harness import run_ranks
from deck.testing.faulty_storage import FaultyStorage

pytestmark = pytest.mark.slow

SPEC = ModelSpec(num_tables=2, rows=200, dim=8, batch=16, sharding="table_wise")  # the DLRM served
FOREIGN = ModelSpec(
    num_tables=2, rows=120, dim=8, batch=16, sharding="table_wise"
)  # same table names, other shapes
EC = ModelSpec(num_tables=2, rows=150, dim=8, batch=16, collection="ec", sharding="table_wise")
EC_LAST = 6
FOREIGN_STEP = 20


def _publish(
    spec: ModelSpec, ckpt: str, pub: str, steps: range, every: int, take_over: bool = False
) -> None:
    model, opt = build_model(spec)
    publish = deck.PublishConfig(uri=pub, every_steps=every, take_over=take_over)
    config = deck.DeckConfig(uri=ckpt, publish=publish)
    with deck.enable(model, [opt], config) as ck:
        for step in steps:
            if step:
                train_step(model, opt, spec, step)
            ck.step(step)
        assert ck.flush()


def _jobs(rank: int, world_size: int, root: str) -> None:
    _publish(SPEC, f"{root}/ckpt", f"{root}/pub", range(0, 5), 2)
    _publish(EC, f"{root}/ckpt-ec", f"{root}/pub-ec", range(0, EC_LAST + 1), 2)
    # Another model's job pointed at (a copy of) the DLRM's publish URI, told to take it over:
    # its first publish, a full, is the newest step there.
    if rank == 0:
        shutil.copytree(f"{root}/pub", f"{root}/pub-foreign")
    torch.distributed.barrier()
    _publish(
        FOREIGN,
        f"{root}/ckpt-foreign",
        f"{root}/pub-foreign",
        range(FOREIGN_STEP, FOREIGN_STEP + 1),
        FOREIGN_STEP,
        take_over=True,
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = str(tmp_path_factory.mktemp("live-paths"))
    run_ranks(_jobs, tmp)
    return tmp


# ---- a foreign update -------------------------------------------------------------------------
def test_a_foreign_update_is_refused_and_the_served_version_stays(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    served = serving_models(SPEC)
    faults: list[LiveFault] = []
    live = LiveModel(list(served.values()), LocalStorage(pub), on_fault=faults.append)
    assert [s.step for s in live.poll()] == [4]
    before = {k: copy.deepcopy(m.state_dict()) for k, m in served.items()}
    version = live.version

    # The same model's URI, now with another model's full (120-row tables) committed at step 20.
    shutil.rmtree(pub)
    shutil.copytree(f"{root}/pub-foreign", pub)
    assert sorted(read_manifests(LocalStorage(pub))) == [0, 2, 4, FOREIGN_STEP]
    with caplog.at_level(logging.ERROR, logger="deck.serve.live"):
        assert live.poll() == []
    assert live.version == version and live.step == 4
    for kind, model in served.items():
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[kind][key]), (kind, key)
    assert len(faults) == 1
    fault = faults[0]
    assert fault.step == FOREIGN_STEP and fault.serving == version and fault.uri == pub
    assert "step-000000000020" in fault.checkpoint
    assert "(120, 8)" in fault.error and "(200, 8)" in fault.error
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "not applied" in errors[0] and "serving step 4" in errors[0]
    # It is not tried again: nothing read, nothing logged.
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="deck.serve.live"):
        assert live.poll() == []
    assert live.step == 4 and len(faults) == 1 and not caplog.records


def _timelines(rank: int, world_size: int, root: str, rollback: bool, last: int = 4) -> None:
    """A trainer checkpointing and publishing steps 0..6; with ``rollback``, rolled back to
    step 2 (bad data found, say) and trained on to step ``last``: a newer timeline whose steps
    are below the one served (or, ``last`` 6, re-save the served step)."""
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=f"{root}/ckpt",
        delta_every_steps=2,
        publish=deck.PublishConfig(uri=f"{root}/pub", every_steps=2),
    )
    with deck.enable(model, [opt], config) as ck:
        if rollback:
            assert ck.restore(2) == 2
        for step in range(3, last + 1) if rollback else range(0, 7):
            if step:
                train_step(model, opt, SPEC, step + 100 * rollback)  # (other data then)
            ck.step(step)
        assert ck.flush()


def _raise(switch: VersionSwitch) -> None:
    raise RuntimeError(f"a user's callback failed at step {switch.step}")


@pytest.mark.parametrize("on_switch", [None, _raise], ids=["quiet", "raising_callback"])
def test_a_rollback_of_the_trainer_is_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, on_switch: Any
) -> None:
    """A break-it finding: after the trainer rolled back (restore(2), trained on to step 4) the
    live model kept serving step 6 of the abandoned timeline -- a fault "out of order" -- while
    `deck follow` went to the new timeline. The newer timeline's step is served now, bitwise,
    the kept versions (of the old timeline) dropped, said once. An ``on_switch`` that raises
    changes none of it (before, it skipped the drop: a rollback could go back to a step of the
    abandoned timeline)."""
    root = str(tmp_path)
    run_ranks(_timelines, root, False)
    served = serving_models(SPEC)
    faults: list[LiveFault] = []
    live = LiveModel(
        list(served.values()),
        LocalStorage(f"{root}/pub"),
        on_fault=faults.append,
        on_switch=on_switch,
    )
    assert [s.step for s in live.poll()] == [6]
    live.rollback(4)  # a kept version, then on again
    live.resume()
    assert [s.step for s in live.poll()] == [6] and live.kept_steps()
    run_ranks(_timelines, root, True)
    with caplog.at_level(logging.WARNING, logger="deck.serve.live"):
        assert [(s.step, s.kind) for s in live.poll()] == [(4, "full")]
        assert live.poll() == []
    assert not faults and live.kept_steps() == []
    assert not bitwise_diff(served, reference(f"{root}/pub", 4, SPEC))
    said = [r.getMessage() for r in caplog.records if "newer timeline" in r.getMessage()]
    assert len(said) == 1 and "replaces the served step 6" in said[0], said
    # The operator's own rollback to the older timeline's step 2, then resume(): the newest
    # timeline comes back, said as what it is, not blamed on the publisher (a break-it finding)
    caplog.clear()
    assert live.rollback(2) is not None
    live.resume()
    with caplog.at_level(logging.INFO, logger="deck.serve.live"):
        assert [s.step for s in live.poll()] == [4]
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "timeline" in r.getMessage()]
    assert len(said) == 1 and said[0][0] == logging.INFO, said
    assert "resumed after a rollback, onto the newest timeline" in said[0][1], said


def test_a_rollback_that_re_saves_the_served_step_is_followed(tmp_path: Path) -> None:
    """A break-it finding: the trainer restarted from an older checkpoint (or rolled back) and
    published the served step again, replacing its commit record: the live model took the
    newer timeline's step for one "out of order" and served the abandoned weights for good
    (``deck follow`` moved on)."""
    root = str(tmp_path)
    run_ranks(_timelines, root, False)
    served = serving_models(SPEC)
    faults: list[LiveFault] = []
    live = LiveModel(list(served.values()), LocalStorage(f"{root}/pub"), on_fault=faults.append)
    assert [s.step for s in live.poll()] == [6]
    old = live.version
    run_ranks(_timelines, root, True, 6)
    assert [(s.step, s.kind) for s in live.poll()] == [(6, "full")]
    assert not faults and live.version != old and live.kept_steps() == []
    assert not bitwise_diff(served, reference(f"{root}/pub", 6, SPEC))


def test_a_rollback_to_a_kept_step_the_trainer_saved_again_serves_the_new_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: the trainer rolled back (restore(2)) and published step 4 again
    before the live model polled; ``rollback(4)`` then wrote back the kept rows of the
    abandoned step 4 and served them as step 4. A kept version whose step's commit record now
    names another checkpoint is rebuilt from storage instead: ``restore(4)``, bitwise."""
    root = str(tmp_path)
    run_ranks(_timelines, root, False)
    served = serving_models(SPEC)
    live = LiveModel(list(served.values()), LocalStorage(f"{root}/pub"))
    assert [s.step for s in live.poll()] == [6]
    live.rollback(4)
    live.resume()
    assert [s.step for s in live.poll()] == [6] and live.kept_steps() == [4]
    run_ranks(_timelines, root, True)  # the trainer publishes step 4 again
    now = read_manifests(LocalStorage(f"{root}/pub"))[4].id
    with caplog.at_level(logging.INFO, logger="deck.serve.live"):
        switch = live.rollback(4)
    assert switch is not None and switch.kind == "reload"
    assert live.version == (4, now) and live.kept_steps() == []
    assert not bitwise_diff(served, reference(f"{root}/pub", 4, SPEC))
    said = [r.getMessage() for r in caplog.records if "abandoned timeline" in r.getMessage()]
    assert len(said) == 1 and now in said[0], said


def test_an_out_of_order_update_is_refused_and_the_served_version_stays(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 4 served, then its folder deleted: the source offers step 2, whose delta's parent is
    not the served version and whose step is behind it. Nothing changes, one ERROR, a fault."""
    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    served = serving_models(SPEC)
    faults: list[LiveFault] = []
    live = LiveModel(list(served.values()), LocalStorage(pub), on_fault=faults.append)
    assert [(s.step, s.kind) for s in live.poll()] == [(4, "full")]
    before = {k: copy.deepcopy(m.state_dict()) for k, m in served.items()}
    version = live.version
    shutil.rmtree(Path(pub, step_dir(4)))
    m2 = read_manifests(LocalStorage(pub))[2]
    assert sorted(read_manifests(LocalStorage(pub))) == [0, 2]
    assert (m2.parent, m2.parent_id) != version  # a delta of a state not served
    with caplog.at_level(logging.ERROR, logger="deck.serve.live"):
        assert live.poll() == []
    assert live.version == version and live.step == 4
    for kind, model in served.items():
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[kind][key]), (kind, key)
    assert not bitwise_diff(served, reference(f"{root}/pub", 4, SPEC))
    assert len(faults) == 1, faults
    fault = faults[0]
    assert fault.step == 2 and fault.serving == version and fault.checkpoint == m2.folder
    assert "out of order" in fault.error and "served step 4" in fault.error
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and m2.folder in errors[0] and "serving step 4" in errors[0]
    # Told once: polling again reports nothing new and changes nothing.
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="deck.serve.live"):
        assert live.poll() == []
    assert live.step == 4 and len(faults) == 1 and not caplog.records
    # The step comes back (a newer one would do too): nothing to apply, nothing refused.
    shutil.copytree(Path(root, "pub", step_dir(4)), Path(pub, step_dir(4)))
    assert live.poll() == [] and live.version == version and len(faults) == 1


def test_a_damaged_commit_record_is_a_fault_and_the_served_version_stays(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a user trying to break it: a newer step whose manifest.json had a flipped byte
    was only two WARNING lines from the readers, on every poll, and never reached ``on_fault``,
    so serving stalled unseen. It is a fault (one ERROR, told once); the version stays. The
    readers' WARNING is said once too, not at every poll (a later break-it finding)."""
    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    shutil.rmtree(Path(pub, step_dir(4)))
    served = serving_models(SPEC)
    faults: list[LiveFault] = []
    live = LiveModel(list(served.values()), LocalStorage(pub), on_fault=faults.append)
    live.poll()
    assert live.step == 2
    shutil.copytree(Path(root, "pub", step_dir(4)), Path(pub, step_dir(4)))
    record = Path(pub, step_dir(4), "manifest.json")
    data = bytearray(record.read_bytes())
    data[len(data) // 2] ^= 0x01
    record.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert live.poll() == []
        assert live.poll() == []
        assert live.poll() == []
    assert live.step == 2 and not bitwise_diff(served, reference(f"{root}/pub", 2, SPEC))
    readers = [r for r in caplog.records if r.name == "deck.read.catalog"]
    assert len(readers) == 1 and "step 4 is not restorable" in readers[0].getMessage(), readers
    assert [f.step for f in faults] == [4], faults
    assert "damaged commit record" in faults[0].error and step_dir(4) in faults[0].error
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and step_dir(4) in errors[0], errors


def test_the_deltas_after_a_refused_step_are_said_to_wait(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a delta built on a refused (damaged) step was passed over without
    a word, the model silently stale until the next full. Said once; the version stays."""
    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    for step in (2, 4):
        shutil.rmtree(Path(pub, step_dir(step)))
    served = serving_models(SPEC)
    live = LiveModel(list(served.values()), LocalStorage(pub))
    assert [s.step for s in live.poll()] == [0]
    shutil.copytree(Path(root, "pub", step_dir(2)), Path(pub, step_dir(2)))
    chunk = next(p for p in sorted(Path(pub, step_dir(2)).rglob("*")) if p.suffix == ".chunk")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    assert live.poll() == [] and [f.step for f in live.faults] == [2]
    shutil.copytree(Path(root, "pub", step_dir(4)), Path(pub, step_dir(4)))
    with caplog.at_level(logging.WARNING, logger="deck.serve"):
        assert live.poll() == [] and live.poll() == []
    said = [r.getMessage() for r in caplog.records if "builds on a refused" in r.getMessage()]
    assert len(said) == 1 and "step 4" in said[0], said
    assert live.step == 0 and not bitwise_diff(served, reference(f"{root}/pub", 0, SPEC))


def test_a_step_damaged_when_first_read_is_applied_once_it_reads_whole(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a publish URI filled by a copy that lands the commit record before
    the chunks (a sync tool) showed a step with a chunk missing; it was refused and never read
    again, the model stale until the next full with nothing said after the first ERROR (a
    fresh replica served it). Now it is read again after a wait that doubles (not said again
    while the problem is the same) and applied once whole, bitwise, with what builds on it."""
    from deck.serve.damaged import RETRY_FIRST_S

    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    chunk = next(p for p in sorted(Path(pub, step_dir(2)).rglob("*")) if p.suffix == ".chunk")
    aside = tmp_path / "chunk"
    chunk.rename(aside)
    now = [0.0]
    served = serving_models(SPEC)
    live = LiveModel(
        list(served.values()), LocalStorage(pub), clock=lambda: now[0], sleep=lambda s: None
    )
    with caplog.at_level(logging.DEBUG, logger="deck.serve"):
        assert [s.step for s in live.poll()] == [0]
        (fault,) = live.faults  # (step 4's whole chain refused: its delta of step 2)
        assert step_dir(2) in fault.checkpoint and "read again later" in fault.error, fault
        now[0] += RETRY_FIRST_S  # read again: still missing, not said again
        assert live.poll() == [] and len(live.faults) == 1
        assert live.poll() == []  # (waiting: not read)
        aside.rename(chunk)  # the copy lands
        assert live.poll() == []  # (its wait, doubled, is not over)
        now[0] += 2 * RETRY_FIRST_S
        assert [s.step for s in live.poll()] == [2, 4]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and said[0].startswith(f"deck live: step 4 of {pub} not applied ("), said
    assert f"{step_dir(2)}/" in said[0], said
    reads = [r for r in caplog.records if "still damaged" in r.getMessage()]
    assert len(reads) == 1, [r.getMessage() for r in caplog.records]
    assert any("reads whole now" in r.getMessage() for r in caplog.records)
    assert len(live.faults) == 1
    assert not bitwise_diff(served, reference(f"{root}/pub", 4, SPEC))


def test_a_request_outside_a_table_is_refused_naming_it(root: str) -> None:
    """Found by a user trying to break it: ids past a table's end went through the gate as
    another table's rows (or raised a bare IndexError)."""
    served = serving_models(SPEC)
    live = LiveModel(list(served.values()), LocalStorage(f"{root}/pub"))
    (key, (rows, _)), *_ = live.tables.shapes.items()
    for bad in (rows, -1, 10**6):
        with pytest.raises(ConfigError, match=f"row {bad} of table"), live.serving({key: [0, bad]}):
            pass
    with live.serving({key: [0, rows - 1]}) as v:
        assert v.step == -1
    # Break-it findings: float ids were truncated to rows (1.7 served row 1), and a list as
    # the batch was an AttributeError from inside
    with pytest.raises(ConfigError, match="must be integers"), live.serving({key: [0.0, 1.7]}):
        pass
    with pytest.raises(ConfigError, match="KeyedJaggedTensor or a mapping"), live.serving([0, 1]):
        pass


def test_a_foreign_uri_is_refused_before_the_first_version(root: str) -> None:
    # A model whose tables are not the publisher's: nothing is served from it.
    served = serving_models(FOREIGN)
    live = LiveModel(list(served.values()), LocalStorage(f"{root}/pub"))
    assert live.poll() == []
    assert live.step == -1 and [f.step for f in live.faults] == [4]
    assert "(200, 8)" in live.faults[0].error


def test_a_uri_string_as_the_source_is_refused_at_construction(root: str) -> None:
    """A break-it finding: ``LiveModel(models, "path")`` was taken, then every poll failed
    (and the background applier's thread died on it)."""
    served = serving_models(SPEC)
    with pytest.raises(ConfigError, match=r"give a Storage \(open_storage\(uri\)"):
        LiveModel(list(served.values()), f"{root}/pub")  # type: ignore[arg-type]


# ---- EmbeddingCollection ----------------------------------------------------------------------
def _ec_configs(spec: ModelSpec) -> list[Any]:
    from torchrec import EmbeddingConfig

    return [
        EmbeddingConfig(
            name=f"t{i}", embedding_dim=spec.dim, num_embeddings=spec.rows, feature_names=[f"f{i}"]
        )
        for i in range(spec.num_tables)
    ]


def _ec_models(seed: int = 7) -> dict[str, torch.nn.Module]:
    """A float EmbeddingCollection at ``ec`` (the trained SequenceModel's path) and TorchRec's
    int8 quantisation of it."""
    from torchrec import EmbeddingCollection
    from torchrec.inference.modules import quantize_embeddings

    torch.manual_seed(seed)
    holder = torch.nn.ModuleDict({"ec": EmbeddingCollection(tables=_ec_configs(EC))})
    return {
        "float": holder,
        "int8": quantize_embeddings(copy.deepcopy(holder), dtype=torch.qint8, inplace=False),
    }


def _ec_reference(pub: str, step: int) -> dict[str, torch.nn.Module]:
    from torchrec import EmbeddingCollection
    from torchrec.inference.modules import quantize_embeddings

    storage = LocalStorage(pub)
    chain = cheapest_chain(lineage_graph(storage), step)
    ec = EmbeddingCollection(tables=_ec_configs(EC))
    shards = [
        TableShard.whole(
            f"ec.embeddings.{c.name}.weight",
            {"weight": ec.embeddings[c.name].weight.data},
            replicated=True,
        )
        for c in _ec_configs(EC)
    ]
    apply_chain(storage, chain, shards, {s.table: (EC.rows, EC.dim) for s in shards})
    holder = torch.nn.ModuleDict({"ec": ec})
    return {
        "float": holder,
        "int8": quantize_embeddings(copy.deepcopy(holder), dtype=torch.qint8, inplace=False),
    }


def _ec_diff(served: dict[str, torch.nn.Module], ref: dict[str, torch.nn.Module]) -> list[str]:
    bad = []
    for kind in ("float", "int8"):
        got, want = served[kind].state_dict(), ref[kind].state_dict()
        assert set(got) == set(want) and got, kind
        bad += state_diff(kind, got, want)
    return bad


def test_an_embedding_collection_is_served_live_float_and_int8(root: str) -> None:
    pub = f"{root}/pub-ec"
    served = _ec_models()
    live = LiveModel(list(served.values()), LocalStorage(pub), LiveConfig(keep_versions=2))
    assert set(live.tables.by_key) == {"ec.embeddings.t0.weight", "ec.embeddings.t1.weight"}
    assert [s.step for s in live.poll()] == [EC_LAST]
    assert not _ec_diff(served, _ec_reference(pub, EC_LAST))
    # A request's answer is the reference's, on each copy.
    kjt = make_batch(dataclasses.replace(EC, batch=4), 99, 0)[1]
    ref = _ec_reference(pub, EC_LAST)
    for kind in ("float", "int8"):
        with live.serving(kjt) as v, torch.no_grad():
            got = served[kind]["ec"](kjt)
            want = ref[kind]["ec"](kjt)
        assert v.step == EC_LAST
        for f in ("f0", "f1"):
            assert torch.equal(got[f].values(), want[f].values()), (kind, f)
    # Back one published step (from storage: nothing kept yet), then forward by its delta.
    switch = live.rollback(4)
    assert switch is not None and switch.kind == "reload"
    assert not _ec_diff(served, _ec_reference(pub, 4))
    live.resume()
    assert [(s.step, s.kind) for s in live.poll()] == [(EC_LAST, "delta")]
    assert not _ec_diff(served, _ec_reference(pub, EC_LAST))


# ---- the background applier -------------------------------------------------------------------
class Switches:
    """``on_switch``: records each switch and lets a test wait for one (the outcome is the
    event's, the timeout only ends a hung test)."""

    def __init__(self) -> None:
        self.got: list[VersionSwitch] = []
        self.cond = threading.Condition()

    def __call__(self, s: VersionSwitch) -> None:
        with self.cond:
            self.got.append(s)
            self.cond.notify_all()

    def wait_for(self, n: int) -> list[VersionSwitch]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, timeout=120), self.got
            return list(self.got)


def test_the_background_applier_applies_and_stops(root: str) -> None:
    pub = f"{root}/pub"
    served = serving_models(SPEC)
    switches = Switches()
    # One poll at start, then the next in an hour: stop() must not wait for it.
    live = LiveModel(
        list(served.values()), LocalStorage(pub), LiveConfig(poll_s=3600), on_switch=switches
    )
    live.start()
    live.start()  # already running: no second thread
    got = switches.wait_for(1)
    live.stop()
    assert not [t for t in threading.enumerate() if t.name == "deck-live"]
    assert [(s.step, s.kind) for s in got] == [(4, "full")]
    assert live.step == 4
    assert not bitwise_diff(served, reference(pub, 4, SPEC))
    live.stop()  # stopping a stopped applier is a no-op
    # A held model: the applier runs but applies nothing until resume().
    live.rollback(2)
    live.start()
    live.stop()
    assert live.step == 2 and live.held
    # close(): stopped for good (a break-it finding: there was none); what is served stays
    live.start()
    live.close()
    assert not [t for t in threading.enumerate() if t.name == "deck-live"]
    with live.serving() as v:
        assert v.step == 2
    for call in (live.poll, live.start):
        with pytest.raises(ConfigError, match=r"after close\(\): this LiveModel"):
            call()


def test_a_failed_poll_is_logged_and_polled_again(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    pub = f"{root}/pub"
    served = serving_models(SPEC)
    failures: list[str] = []

    def fail_first_reads(key: str, n: int) -> bool:
        if len(failures) < 2:
            failures.append(key)
            return True
        return False

    store = FaultyStorage(LocalStorage(pub), fail_get=fail_first_reads)
    switches = Switches()
    live = LiveModel(list(served.values()), store, LiveConfig(poll_s=0.01), on_switch=switches)
    with caplog.at_level(logging.WARNING, logger="deck.serve.live"):
        live.start()
        try:
            got = switches.wait_for(1)
        finally:
            live.stop()
    assert got[0].step == 4 and live.step == 4
    assert len(failures) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all("retrying" in w and pub in w for w in warnings)
    assert not live.faults  # a store error is not a refused update


def test_a_uri_with_nothing_published_is_said_once(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo'd publish URI used to be polled forever without a word."""
    typo = str(tmp_path / "pbu")
    served = serving_models(SPEC)
    live = LiveModel(list(served.values()), LocalStorage(typo))
    with caplog.at_level(logging.INFO, logger="deck"):
        assert live.poll() == [] and live.poll() == [] and live.poll() == []
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1, warned
        assert f"nothing is published at {typo}" in warned[0] and "PublishConfig.uri" in warned[0]
        assert not live.faults and live.step == -1
        # the publisher shows up there after all: served, and said
        shutil.copytree(f"{root}/pub", typo, dirs_exist_ok=True)
        assert live.poll()
        assert any("a committed step is there now" in r.getMessage() for r in caplog.records)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_rollback_before_any_version_or_to_a_bad_step_says_why(root: str) -> None:
    served = serving_models(SPEC)
    live = LiveModel(list(served.values()), LocalStorage(f"{root}/pub"), LiveConfig())
    with pytest.raises(CheckpointNotFoundError, match=r"no version .* is served yet"):
        live.rollback(0)
    assert not live.held
    live.poll()
    live.rollback(0)
    live.resume()
    live.poll()
    kept = live.kept_steps()
    assert kept
    with pytest.raises(
        ConfigError, match=rf"rollback to step -1: .*kept steps {re.escape(str(kept))}"
    ):
        live.rollback(-1)
    with pytest.raises(
        CheckpointNotFoundError, match=rf"rollback to step 1: .*kept steps {re.escape(str(kept))}"
    ):
        live.rollback(1)  # never published
    for wrong in ("2", None, 2.0, True):  # (a bare TypeError from a comparison before)
        with pytest.raises(ConfigError, match=r"rollback\(step\): a step is an int"):
            live.rollback(wrong)  # type: ignore[arg-type]
    assert not live.held
    with pytest.raises(
        CheckpointNotFoundError, match=rf"the served step is .*kept steps {re.escape(str(kept))}"
    ):
        live.rollback(live.step + 1)
    # An integer of numpy or a 0-d tensor is a step (a break-it finding: refused as no int)
    back = min(kept)
    assert live.rollback(torch.tensor(back)) is not None and live.step == back  # type: ignore[arg-type]
    assert live.rollback(numpy.int64(back)) is None and live.held  # type: ignore[arg-type]
    live.resume()
    live.poll()
    with pytest.raises(ConfigError, match="rows_per_s"):
        LiveConfig(rows_per_s=0.5)  # (1e-300 used to be taken, then overflow mid-version)


def test_a_rollback_whose_chain_is_gone_names_what_is_missing(root: str, tmp_path: Path) -> None:
    """A break-it finding: with the full of the chain deleted, a rollback further back than the
    kept versions said "no committed checkpoints at URI", though newer steps were committed
    there. It now names the checkpoint the chain lacks; the served version stays."""
    pub = tmp_path / "pub"
    shutil.copytree(f"{root}/pub", pub)
    live = LiveModel(
        list(serving_models(SPEC).values()), LocalStorage(str(pub)), LiveConfig(keep_versions=0)
    )
    live.poll()
    served = live.step
    manifests = read_manifests(LocalStorage(str(pub)))
    first_full = min(s for s, m in manifests.items() if m.kind.value == "full")
    older = max(s for s in manifests if first_full < s < served)
    shutil.rmtree(pub / manifests[first_full].folder)
    with pytest.raises(CheckpointNotFoundError, match=rf"rollback to step {older}: .*missing"):
        live.rollback(older)
    assert live.step == served and not live.held


# ---- found by a user trying to break it -----------------------------------------------------------
def _shared_feature_models() -> dict[str, torch.nn.Module]:
    """The served DLRM's tables (same keys and shapes), both read by feature f0."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=SPEC.dim, num_embeddings=SPEC.rows, feature_names=["f0"]
        )
        for i in range(SPEC.num_tables)
    ]
    torch.manual_seed(5)
    return {
        "float": torch.nn.ModuleDict(
            {"embedding_bag_collection": EmbeddingBagCollection(tables=configs)}
        )
    }


def test_a_feature_two_served_tables_read_declares_its_rows_in_both(
    root: str, tmp_path: Path
) -> None:
    """A request's ids of a feature two tables read were declared in one of them only: let in
    while the other table's rows of it were half written, it read rows of two versions under
    one version's label. It waits now, and reads the version it is labelled with."""
    from torchrec import KeyedJaggedTensor

    from deck.serve.live_tables import request_rows

    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    shutil.rmtree(Path(pub, step_dir(4)))
    served = _shared_feature_models()
    weights = {
        t: served["float"]["embedding_bag_collection"].embedding_bags[t].weight
        for t in ("t0", "t1")
    }
    live = LiveModel(
        list(served.values()), LocalStorage(pub), LiveConfig(rows_per_s=None), prefix="sparse_arch"
    )
    assert [s.step for s in live.poll()] == [2]
    shutil.copytree(Path(root, "pub", step_dir(4)), Path(pub, step_dir(4)))
    (plan,) = live.source.next_plans(live.version, frozenset())
    version = live.prepare(plan)
    keys = sorted(version.tables)
    assert len(keys) == 2  # the delta has rows in both tables
    applying = live.begin(version)
    applying.step(1)  # one row of the version written
    table, row = next(
        (k, int(version.tables[k].ids[i]))
        for k in keys
        for i in range(version.tables[k].ids.numel())
        if i not in set(applying.rest[k].tolist())
    )
    other = next(k for k in keys if k != table)
    pending = int(version.tables[other].ids[0])
    ids = torch.tensor([row, pending])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0"], values=ids, lengths=torch.tensor([2], dtype=torch.int32)
    )
    declared = request_rows(live.tables, kjt)
    assert sorted(declared) == keys and all(torch.equal(v, ids) for v in declared.values())
    seen: dict[str, Any] = {}

    def request() -> None:
        with live.serving(kjt) as v:
            seen["step"] = v.step
            seen["rows"] = {t: w[ids].clone() for t, w in weights.items()}

    reader = threading.Thread(target=request)
    reader.start()
    while reader.is_alive() and not live.gate.row_waiters:  # (no timing: either happens)
        threading.Event().wait(0.001)
    assert reader.is_alive(), f"a request on rows of two versions ran: {seen}"
    while not applying.step(1):
        pass
    live.finished(applying)
    reader.join()
    ref = reference(pub, seen["step"], SPEC)["float"]
    for t, got in seen["rows"].items():
        assert torch.equal(got, ref.embedding_bags[t].weight[ids]), (t, seen["step"])


def test_an_apply_that_fails_part_way_leaves_the_served_version_whole(
    root: str, tmp_path: Path
) -> None:
    """An error between two slices (a pause that overflowed, with rows_per_s=1e-300) left half
    the version written under the old label and the gate stuck: every later request and poll
    hung. The rows written go back, the version in flight is dropped, and the next poll
    applies it whole."""
    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    shutil.rmtree(Path(pub, step_dir(4)))
    served = serving_models(SPEC)
    broken = [False]
    raised_in_flight = []

    def sleep(seconds: float) -> None:
        # (the pause between two slices of a version: not the one before it is read)
        if broken[0] and live.gate.flight is not None:
            broken[0] = False
            raised_in_flight.append(live.gate.flight.new)
            raise OverflowError("timestamp out of range for platform time_t")

    live = LiveModel(
        list(served.values()),
        LocalStorage(pub),
        LiveConfig(rows_per_s=1.0, slice_rows=8, keep_versions=0),
        sleep=sleep,
        clock=lambda: 0.0,
    )
    assert [s.step for s in live.poll()] == [2]
    before = {k: copy.deepcopy(m.state_dict()) for k, m in served.items()}
    version = live.version
    shutil.copytree(Path(root, "pub", step_dir(4)), Path(pub, step_dir(4)))
    broken[0] = True
    with pytest.raises(OverflowError):
        live.poll()
    assert [s for s, _ in raised_in_flight] == [4]
    assert live.version == version and live.gate.flight is None
    for kind, model in served.items():
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[kind][key]), (kind, key)
    with live.serving(None) as v:  # (a request that declares no rows: it hung)
        assert (v.step, v.ckpt_id) == version
    assert [s.step for s in live.poll()] == [4]
    assert not bitwise_diff(served, reference(f"{root}/pub", 4, SPEC))


def test_a_delta_of_another_job_is_a_fault_once_and_not_applied(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another job's delta copied into the publish URI (its parent a state this URI does not
    hold) was passed over with a WARNING of the lineage on every poll, advice for a trainer,
    and never reached on_fault: serving stalled unseen. One ERROR and one LiveFault now."""
    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    served = serving_models(SPEC)
    faults: list[LiveFault] = []
    live = LiveModel(list(served.values()), LocalStorage(pub), on_fault=faults.append)
    assert [s.step for s in live.poll()] == [4]
    version = live.version
    shutil.copytree(Path(root, "pub-ec", step_dir(EC_LAST)), Path(pub, step_dir(EC_LAST)))
    with caplog.at_level(logging.WARNING, logger="deck"):
        assert live.poll() == [] and live.poll() == [] and live.poll() == []
    assert live.version == version
    assert not bitwise_diff(served, reference(f"{root}/pub", 4, SPEC))
    assert len(faults) == 1, faults
    assert faults[0].step == EC_LAST and step_dir(EC_LAST) in faults[0].checkpoint
    assert "another timeline" in faults[0].error and pub in faults[0].error
    logged = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(logged) == 1 and logged[0][0] == logging.ERROR, logged
    assert step_dir(EC_LAST) in logged[0][1] and "serving step 4" in logged[0][1]


def test_a_serving_model_with_dynamically_quantised_mlps_is_refused(tmp_path: Path) -> None:
    """From a break-it run: MLPs under torch's dynamic quantisation hold packed weights, not
    tensors; they were passed over, and each version's tables were served under the MLPs the
    model was built with, labelled with the version's step. Refused at construction now."""
    served = serving_models(SPEC)
    mlps = torch.ao.quantization.quantize_dynamic(
        copy.deepcopy(served["int8"]), {torch.nn.Linear}, dtype=torch.qint8
    )
    with pytest.raises(UnsupportedError, match="not a plain tensor"):
        LiveModel([served["float"], mlps], LocalStorage(str(tmp_path)))


@pytest.mark.timeout(120)
def test_stop_writes_the_version_in_flight_without_the_caps_pauses(root: str) -> None:
    """From a break-it run: stop() waited for the version being written at its cap (seconds
    for a capped full). The rest of that version is written at once; the model serves it
    whole, and poll() by hand goes on afterwards."""
    served = serving_models(SPEC)
    live = LiveModel(
        list(served.values()),
        LocalStorage(f"{root}/pub"),
        LiveConfig(rows_per_s=1.0, slice_rows=1, poll_s=0.01),  # ~400 s for the first version
    )
    live.start()
    until(lambda: live.gate.flight is not None and live.gate.flight.new[0] == 4)
    live.stop()
    assert live.step == 4 and not bitwise_diff(served, reference(f"{root}/pub", 4, SPEC))
    assert live.poll() == []  # nothing newer; poll() after stop() polls as before


# ---- callbacks, stop and close ----------------------------------------------------------------
def _in_thread(call: Any) -> None:
    """Run ``call`` on a thread of its own; a hang guard, not a timing: it fails the test
    instead of hanging the suite."""
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(300)
    assert not t.is_alive(), "hung"


def test_callbacks_may_call_back_into_the_live_model(root: str) -> None:
    """A break-it finding: ``on_switch`` calling ``rollback()`` (a canary's automatic rollback)
    and ``on_fault`` calling ``resume()`` hung for good (the callbacks ran under the applier's
    lock). They are called once it is released."""
    pub = f"{root}/pub"
    served = serving_models(SPEC)
    calls: list[str] = []

    def canary(switch: VersionSwitch) -> None:
        calls.append(f"switch {switch.step}")
        if switch.step == 4:
            live.rollback(2)

    live = LiveModel(list(served.values()), LocalStorage(pub), on_switch=canary)
    assert [s.step for s in live.poll()] == [4]  # (the whole version of the newest step)
    live.rollback(0)
    live.resume()
    _in_thread(live.poll)
    assert live.step == 2 and live.held, calls
    assert not bitwise_diff(served, reference(pub, 2, SPEC))

    faulty = serving_models(SPEC)
    foreign = LiveModel(
        list(faulty.values()),
        LocalStorage(f"{root}/pub-foreign"),
        on_fault=lambda f: (calls.append(f"fault {f.step}"), foreign.resume()),
    )
    _in_thread(foreign.poll)
    assert foreign.step == 4 and f"fault {FOREIGN_STEP}" in calls


def test_stop_from_a_callback_on_the_applier_thread_stops_it_and_start_starts_it_again(
    root: str, tmp_path: Path
) -> None:
    """A break-it finding: ``stop()`` from ``on_switch`` on the background thread raised
    "cannot join current thread" (logged as "the applier goes on"), the thread ended, and
    ``start()`` did nothing after it (a stale handle): nothing was applied again."""
    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    shutil.rmtree(Path(pub, step_dir(4)))
    served = serving_models(SPEC)
    live = LiveModel(
        list(served.values()),
        LocalStorage(pub),
        LiveConfig(poll_s=0.05),
        on_switch=lambda s: live.stop(),
    )
    live.start()
    until(lambda: live._thread is None)  # stopped by its own callback
    assert live.step == 2
    shutil.copytree(Path(root, "pub", step_dir(4)), Path(pub, step_dir(4)))
    live.on_switch = None
    live.start()
    until(lambda: live.step == 4)
    live.close()
    assert not bitwise_diff(served, reference(pub, 4, SPEC))


def test_close_ends_a_poll_running_on_another_thread(root: str, tmp_path: Path) -> None:
    """A break-it finding: ``close()`` returned at once while a ``poll()`` on another thread
    went on switching versions (and would read a Kafka source it closed). It waits for the
    version in flight; no further version is applied."""
    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    for step in (2, 4):
        shutil.rmtree(Path(pub, step_dir(step)))
    served = serving_models(SPEC)
    closing: list[threading.Thread] = []

    paces: list[float] = []

    def pace(wait_s: float) -> None:  # the cap's pause before each version after the first
        paces.append(wait_s)
        if len(paces) == 2:  # before the second version of the poll: close() from elsewhere
            closing.append(threading.Thread(target=live.close))
            closing[0].start()
            until(lambda: live._closed)  # close() began

    live = LiveModel(
        list(served.values()),
        LocalStorage(pub),
        LiveConfig(rows_per_s=1000),
        clock=lambda: 0.0,  # (time stands still: every version after the first waits)
        sleep=pace,
    )
    assert [s.step for s in live.poll()] == [0]
    for step in (2, 4):
        shutil.copytree(Path(root, "pub", step_dir(step)), Path(pub, step_dir(step)))
    switched: list[VersionSwitch] = []
    _in_thread(lambda: switched.extend(live.poll()))
    closing[0].join(300)
    assert [s.step for s in switched] == [2] and live.step == 2
    with pytest.raises(ConfigError, match="closed"):
        live.poll()
    # Nor a rollback (a break-it finding: it read the closed source and switched the version)
    with pytest.raises(ConfigError, match=r"rollback\(\) after close\(\)"):
        live.rollback(0)
    assert live.step == 2


def test_a_serving_model_of_other_dense_shapes_is_refused_once_not_per_step(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a serving model whose MLPs are of other shapes than the trained
    one's was refused step by step, newest first, each step's whole chain read again back to
    the full (a quadratic first poll over a long publish chain, an ERROR per step). The full
    the chain starts from is refused: one fault, one read."""
    from live_helpers import table_configs
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM

    served = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=table_configs(SPEC)),
        dense_in_features=13,
        dense_arch_layer_sizes=[16, SPEC.dim],  # (trained with 32)
        over_arch_layer_sizes=[32, 1],
    )
    faults: list[LiveFault] = []
    live = LiveModel(served, LocalStorage(f"{root}/pub"), on_fault=faults.append)
    with caplog.at_level(logging.ERROR, logger="deck.serve.live"):
        assert live.poll() == [] and live.poll() == []
    assert len(faults) == 1 and "dense tensor" in faults[0].error, faults
    assert faults[0].step == 4 and step_dir(0) in faults[0].checkpoint
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


def test_deck_follow_says_a_damaged_record_once(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: ``deck follow`` said a damaged commit record's WARNING again at
    every full it materialised (it read the records again to choose the chain it had)."""
    from deck.serve.follow import Follower

    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    record = Path(pub, step_dir(4), "manifest.json")
    data = bytearray(record.read_bytes())
    data[len(data) // 2] ^= 0x01
    record.write_bytes(bytes(data))
    follower = Follower(LocalStorage(pub), str(tmp_path / "out"))
    with caplog.at_level(logging.WARNING):
        assert follower.catch_up().step == 2
        assert follower.catch_up().how == "unchanged"
    said = [r for r in caplog.records if "step 4 is not restorable" in r.getMessage()]
    assert len(said) == 1, said


def test_deck_follow_says_when_another_models_tables_replace_the_held_ones(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: after another model's job took the publish URI over, ``deck follow``
    wrote its 120-row tables over the held 200-row ones without a word."""
    from deck.serve.follow import Follower

    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    follower = Follower(LocalStorage(pub), str(tmp_path / "out"))
    assert follower.catch_up().step == 4
    shutil.rmtree(pub)
    shutil.copytree(f"{root}/pub-foreign", pub)
    with caplog.at_level(logging.WARNING, logger="deck.serve.follow"):
        assert follower.catch_up().step == FOREIGN_STEP
    said = [r.getMessage() for r in caplog.records if "tables at" in r.getMessage()]
    assert len(said) == 1 and re.search(r"t0\.weight 200x8 -> 120x8", said[0]), said


def _restart_below_a_full(rank: int, world_size: int, root: str, restart: bool) -> None:
    """Steps 0..16 published every 2 steps with a full every 6; with ``restart``, the job
    restarts from its checkpoint of step 8 and publishes step 10 (a full of a newer timeline),
    while the older timeline's steps 12..16 stay restorable through its full of step 12."""
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=f"{root}/ckpt",
        delta_every_steps=2,
        publish=deck.PublishConfig(uri=f"{root}/pub", every_steps=2, full_every_steps=6),
    )
    with deck.enable(model, [opt], config) as ck:
        if restart:
            assert ck.restore(8) == 8
        for step in range(9, 11) if restart else range(0, 17):
            if step:
                train_step(model, opt, SPEC, step + 100 * restart)
            ck.step(step)
        assert ck.flush()


def test_a_restart_below_the_last_published_full_is_followed_once(tmp_path: Path) -> None:
    """A break-it finding: with the older timeline's steps above the restart's step still
    restorable (through a full of their own), the live model planned by step alone: one poll
    swapped between the older timeline's step 16 and the newer one's step 10 forever (and a
    new live model served step 16, where restore() gives 10)."""
    root = str(tmp_path)
    run_ranks(_restart_below_a_full, root, False)
    served = serving_models(SPEC)
    live = LiveModel(list(served.values()), LocalStorage(f"{root}/pub"))
    assert [s.step for s in live.poll()] == [16]
    run_ranks(_restart_below_a_full, root, True)
    switched: list[VersionSwitch] = []
    _in_thread(lambda: switched.extend(live.poll()))
    assert [(s.step, s.kind) for s in switched] == [(10, "full")]
    assert live.poll() == []
    assert not bitwise_diff(served, reference(f"{root}/pub", 10, SPEC))
    fresh_models = serving_models(SPEC)
    fresh = LiveModel(list(fresh_models.values()), LocalStorage(f"{root}/pub"))
    switched.clear()
    _in_thread(lambda: switched.extend(fresh.poll()))
    assert [s.step for s in switched] == [10] and fresh.poll() == []
    assert not bitwise_diff(fresh_models, reference(f"{root}/pub", 10, SPEC))


def test_a_step_whose_parent_is_missing_is_said_without_a_trainers_advice(
    root: str, tmp_path: Path
) -> None:
    """A break-it finding: the fault of a published step whose chain lacks a checkpoint ended
    with what a trainer's restore would do ("else restore an older step ..."), no advice to a
    serving process; it says the step is applied once its chain is there."""
    pub = str(tmp_path / "pub")
    shutil.copytree(f"{root}/pub", pub)
    shutil.rmtree(Path(pub, step_dir(2)))
    live = LiveModel(list(serving_models(SPEC).values()), LocalStorage(pub))
    live.poll()
    errors = [f.error for f in live.faults if f.step == 4]
    assert errors and "applied only if the checkpoints its chain needs appear" in errors[0], errors
    assert "restore an older step" not in errors[0], errors
