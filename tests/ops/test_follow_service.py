"""``deck follow URI --out DIR`` as a service (no ``--once``), started on a DIR that is already
up to date: its first line says which step of which URI it serves and that it waits for new
checkpoints (before, it printed nothing at all and looked hung); a new delta is then applied
and announced as before. One follower writes a folder at a time, and a killed one leaves it
free. The real console script on a real checkpoint folder."""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from deck.storage import LocalStorage
from deck.testing.synth import SynthTrainer

if TYPE_CHECKING:
    from deck.serve.follow import Follower

pytestmark = pytest.mark.slow


def _deck() -> str:
    return shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"


def test_a_service_started_up_to_date_says_what_it_serves(tmp_path: Path) -> None:
    uri, out = tmp_path / "pub", tmp_path / "serving"
    trainer = SynthTrainer(LocalStorage(uri))
    trainer.save("full")
    trainer.train()
    trainer.save()
    once = _once(uri, out)
    assert once.returncode == 0 and once.stdout.startswith("step 1 "), once.stdout + once.stderr

    service = subprocess.Popen(
        [_deck(), "follow", str(uri), "--out", str(out), "--poll", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(ln) for ln in service.stdout or ()], daemon=True
    )
    reader.start()
    try:
        # (the timeouts only guard against a hang; nothing here is timed)
        first = lines.get(timeout=300)
        assert first.startswith("serving step 1 ("), first
        assert f"of {uri} in {out}; waiting for new checkpoints" in first, first
        trainer.train()
        trainer.save()  # a new delta: applied and announced, the waiting line not repeated
        second = lines.get(timeout=300)
        assert second.startswith("step 2 (") and ": delta, 1 checkpoint(s) read" in second
        # A second follower on the same --out would interleave its files with this one's
        beside = _once(uri, out)
        assert beside.returncode == 2 and "being written by another deck follow" in beside.stderr
        assert str(out) in beside.stderr, beside.stderr
    finally:
        service.terminate()
        service.wait(timeout=60)
    reader.join(timeout=60)
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert not any(ln.startswith("serving step") for ln in rest), rest


def test_a_killed_follower_leaves_its_out_free(tmp_path: Path) -> None:
    uri, out = tmp_path / "pub", tmp_path / "serving"
    trainer = SynthTrainer(LocalStorage(uri))
    trainer.save("full")
    service = subprocess.Popen(
        [_deck(), "follow", str(uri), "--out", str(out), "--poll", "3600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert service.stdout is not None
        assert service.stdout.readline().startswith("step 0 (")  # wrote it, holds the lock
    finally:
        service.kill()  # SIGKILL: no clean-up of its own
        service.wait(timeout=60)
    trainer.train()
    trainer.save()
    again = _once(uri, out)
    assert again.returncode == 0 and again.stdout.startswith("step 1 "), again.stderr


def _once(uri: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_deck(), "follow", str(uri), "--out", str(out), "--once"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _following(tmp_path: Path, deltas: int) -> tuple[Path, Path, SynthTrainer, Follower]:
    """A publish URI holding a full and ``deltas`` deltas, and a follower serving the newest."""
    from deck.serve.follow import Follower

    uri, out = tmp_path / "pub", tmp_path / "serving"
    trainer = SynthTrainer(LocalStorage(uri))
    trainer.save("full")
    for _ in range(deltas):
        trainer.train()
        trainer.save()
    follower = Follower(trainer.storage, str(out))
    assert follower.catch_up().step == deltas
    return uri, out, trainer, follower


def test_an_out_resumes_when_its_publish_folder_is_reached_through_a_link(tmp_path: Path) -> None:
    """A break-it finding: the same publish folder through a link (a "current" symlink, a moved
    mount) was refused as another URI's output, forcing a rebuild into a new folder. The same
    place resumes; another folder is still refused, naming --out."""
    from deck.errors import ConfigError
    from deck.serve.follow import Follower

    uri, out, trainer, _ = _following(tmp_path, 2)
    (tmp_path / "current").symlink_to(uri)
    trainer.train()
    trainer.save()
    update = Follower(LocalStorage(tmp_path / "current"), str(out)).catch_up()
    assert (update.step, update.how) == (3, "delta"), update
    other = SynthTrainer(LocalStorage(tmp_path / "other"))
    other.save("full")
    with pytest.raises(ConfigError, match=r"--out .* follows .*; use another directory"):
        Follower(other.storage, str(out))


def test_a_follower_never_goes_back_to_an_older_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The held step's folder deleted (a store restored from an older copy): the newest step
    is then an older one of the same timeline, which the follower leaves alone, says once, and
    keeps held through a restart, as a live model does (a break-it finding: it went back to
    step 1 without a word); a newer step, or a newer timeline's lower one, is followed."""
    from deck.serve.follow import Follower, state_record

    uri, out, trainer, follower = _following(tmp_path, 2)
    shutil.rmtree(uri / "step-000000000002")
    for f in (follower, Follower(LocalStorage(uri), str(out)), follower):
        with caplog.at_level("WARNING", logger="deck.serve.follow"):
            update = f.catch_up()
        assert (update.step, update.how) == (2, "unchanged")
        record = state_record(str(out))
        assert record is not None and record["step"] == 2 and record["epoch"] == 0
    said = [r.getMessage() for r in caplog.records if "out of order" in r.getMessage()]
    assert len(said) == 2, said  # once per follower
    assert "the newest step at" in said[0] and "is 1 " in said[0] and "held step 2" in said[0]
    trainer.train()
    trainer.save("full")  # (a delta would need the deleted step 2)
    assert follower.catch_up().step == 3
    trainer.rollback(1)  # a newer timeline: its step 2 is after the held step 3 of epoch 0
    trainer.train()
    trainer.save()
    update = follower.catch_up()
    assert (update.step, update.how) == (2, "full")
    record = state_record(str(out))
    assert record is not None and record["epoch"] == 1


def test_a_damaged_newest_step_is_passed_by_and_the_step_below_served_exactly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A chunk of the newest delta fails its checksum while the follower applies it (rows of
    its other chunks already written into the held tables): the checkpoint is found damaged,
    said once, and the newest step without it is served, bitwise what materialising it from
    scratch gives (break-it findings: a fresh follower served nothing; and the held tables kept
    the rows written before the damage, which a step below it applied onto would serve). A
    fresh follower serves that step too; a newer full is followed."""
    import torch

    from deck.serve.follow import Follower

    uri, out, trainer, follower = _following(tmp_path, 1)
    for _ in range(2):
        trainer.train(rows=40)
        trainer.save()
    chunks = sorted((uri / "step-000000000003").glob("*/rank-*/*/*.chunk"))
    assert len(chunks) > 2
    data = bytearray(chunks[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunks[-1].write_bytes(bytes(data))

    reference = Follower(LocalStorage(uri), str(tmp_path / "ref"))
    reference.materialise(2)
    with caplog.at_level("ERROR", logger="deck.serve.follow"):
        update = follower.catch_up()
        assert (update.step, update.how) == (2, "delta")
        assert follower.catch_up().how == "unchanged"
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and "step-000000000003" in said[0], said
    assert follower.refused.keys() == {3}
    for tensors in (follower.tensors, Follower(LocalStorage(uri), str(out)).tensors):
        assert tensors.keys() == reference.tensors.keys()
        for name, t in reference.tensors.items():
            assert torch.equal(tensors[name], t), name
    fresh = Follower(LocalStorage(uri), str(tmp_path / "fresh"))
    assert (fresh.catch_up().step, fresh.refused.keys()) == (2, {3})
    r = _once(uri, tmp_path / "cli")  # (--once: served, and the damage said, exit 1)
    assert r.returncode == 1 and r.stdout.startswith("step 2 "), r.stdout + r.stderr
    assert "damaged checkpoint(s) of step(s) [3]" in r.stderr, r.stderr
    assert "step-000000000003" in r.stderr and "serving step 2" in r.stderr, r.stderr
    trainer.train()
    trainer.save("full")
    assert follower.catch_up().step == 4


def test_a_step_missing_a_chunk_when_first_read_is_served_once_it_lands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a publish URI filled by a copy that lands the commit record before
    the chunks (a sync tool) showed the newest delta with a chunk missing; the follower passed
    it by and never read it again (a restarted one served it). Now it is read again after a
    wait that doubles, not said again while the problem is the same, and served once whole:
    bitwise what materialising it from scratch gives."""
    import torch

    from deck.serve.damaged import RETRY_FIRST_S
    from deck.serve.follow import Follower

    uri, out, trainer, _ = _following(tmp_path, 1)
    trainer.train(rows=40)
    trainer.save()
    now = [0.0]
    follower = Follower(LocalStorage(uri), str(out), clock=lambda: now[0])
    chunk = sorted((uri / "step-000000000002").glob("*/rank-*/*/*.chunk"))[-1]
    aside = tmp_path / "chunk"
    chunk.rename(aside)
    with caplog.at_level("INFO", logger="deck.serve.follow"):
        assert follower.catch_up().step == 1
        now[0] += RETRY_FIRST_S  # read again: still missing
        assert follower.catch_up().how == "unchanged"
        aside.rename(chunk)  # the copy lands
        assert follower.catch_up().how == "unchanged"  # (its doubled wait is not over)
        assert follower.refused.keys() == {2}
        now[0] += 2 * RETRY_FIRST_S
        update = follower.catch_up()
        assert (update.step, update.how) == (2, "delta")
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and "read again later" in said[0], said
    assert any("reads whole now" in r.getMessage() for r in caplog.records)
    assert not follower.refused
    reference = Follower(LocalStorage(uri), str(tmp_path / "ref"))
    reference.materialise(2)
    assert follower.tensors.keys() == reference.tensors.keys()
    for name, t in reference.tensors.items():
        assert torch.equal(follower.tensors[name], t), name


def test_a_fresh_follower_of_a_damaged_full_says_nothing_can_be_served(tmp_path: Path) -> None:
    """Every step needs the damaged full: nothing to serve, said naming it, not retried in a
    loop around it (each checkpoint is verified once)."""
    from deck.errors import CorruptCheckpointError
    from deck.serve.follow import Follower

    uri = tmp_path / "pub"
    trainer = SynthTrainer(LocalStorage(uri))
    trainer.save("full")
    trainer.train()
    trainer.save()
    chunk = sorted((uri / "step-000000000000").glob("*/rank-*/*/*.chunk"))[0]
    chunk.write_bytes(b"\0" * len(chunk.read_bytes()))
    fresh = Follower(LocalStorage(uri), str(tmp_path / "out"))
    with pytest.raises(
        CorruptCheckpointError, match=r"every restorable step .*\(step 0: .*checksum"
    ):
        fresh.catch_up()
    assert fresh.refused.keys() == {0} and fresh.state is None
    r = _once(uri, tmp_path / "cli")
    assert r.returncode == 1 and "every restorable step" in r.stderr, r.stdout + r.stderr


def test_a_fresh_follower_sees_steps_whose_log_entries_are_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest commit log entries lost (a copy that missed them): the catalog and the log
    left say an older step is the newest, but a follower serves the newest step there is, as a
    restore does: it lists the step folders above the one it would serve (a break-it finding:
    a fresh follower served step 88 of 95 and stayed there)."""
    from deck.format.commit_log import LOG_ROOT, listed_seqs, log_key
    from deck.read.catalog import read_manifests
    from deck.read.indexed import CATALOG_EVERY, compact
    from deck.serve.follow import Follower

    uri = tmp_path / "pub"
    store = LocalStorage(uri)
    trainer = SynthTrainer(store)
    trainer.save("full")
    for _ in range(CATALOG_EVERY):
        trainer.train(rows=4)
        trainer.save()
    index = read_manifests(store).index
    assert index is not None and compact(store, index, force=True) is not None
    for _ in range(4):
        trainer.train(rows=4)
        trainer.save()
    for seq in listed_seqs(store, LOG_ROOT)[-2:]:
        store.delete(log_key(seq))
    newest = CATALOG_EVERY + 4
    fresh = Follower(LocalStorage(uri), str(tmp_path / "out"))
    with caplog.at_level("WARNING", logger="deck.read.lineage"):
        assert fresh.catch_up().step == newest
        assert fresh.catch_up().how == "unchanged"  # (said once, not at every poll)
    said = [r for r in caplog.records if "does not agree" in r.getMessage()]
    assert len(said) == 1, said


@pytest.mark.parametrize("rollback", [False, True])
def test_a_live_source_sees_steps_whose_log_entries_are_lost(
    tmp_path: Path, rollback: bool
) -> None:
    """Break-it findings: the newest commit log entries lost (a copy that missed them), a live
    model's source planned the older step the catalog and the log left say is the newest --
    a step behind for good once the trainer stopped -- or, when the lost entries were a
    rollback's, the abandoned timeline's newest step, which a fresh serving process then
    served. It now checks what it plans against the records as a restore of the latest does
    (the step folders above it, the newest epoch witnessed)."""
    from deck.format.commit_log import LOG_ROOT, listed_seqs, log_key
    from deck.read.catalog import read_manifests
    from deck.read.indexed import compact
    from deck.serve.live_source import PublishSource

    store = LocalStorage(tmp_path / "pub")
    trainer = SynthTrainer(store)
    trainer.save("full")
    for i in range(40):
        trainer.train(rows=4)
        trainer.save("full" if i == 30 else "delta")
    index = read_manifests(store).index
    assert index is not None and compact(store, index, force=True) is not None
    source = PublishSource(LocalStorage(tmp_path / "pub"))
    served = source.next_plans(None, frozenset())[-1].state
    assert served[0] == trainer.step
    before = len(listed_seqs(store, LOG_ROOT))
    if rollback:
        trainer.rollback(10)
    for _ in range(3):
        trainer.train(rows=4)
        trainer.save()
    for seq in listed_seqs(store, LOG_ROOT)[before:]:
        store.delete(log_key(seq))
    want = (trainer.step, trainer.saved[trainer.step].id)
    plans = source.next_plans(served, frozenset())
    assert plans and plans[-1].state == want, [p.state for p in plans]
    fresh = PublishSource(LocalStorage(tmp_path / "pub")).next_plans(None, frozenset())
    assert fresh[-1].state == want


def test_a_flipped_byte_in_the_outputs_data_is_damage_and_the_output_is_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a flipped byte inside the tensor data of ``--out``'s
    ``state.safetensors`` (not its header) went unseen: the follower resumed from it and served
    it, "up to date". The data file carries a checksum of its tensors; a mismatch is damage and
    the output is rebuilt from the checkpoints, bitwise as before."""
    import torch

    from deck.serve.follow import STATE_FILE, Follower
    from deck.testing.kafka_stream import read_output

    uri, out, _, _ = _following(tmp_path, 2)
    before = read_output(str(out))
    assert before is not None
    want = {k: t.clone() for k, t in before[2].items()}  # (read_output maps the file)
    path = out / STATE_FILE
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10  # (a byte of the last tensor's data)
    path.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="deck.serve.follow"):
        update = Follower(LocalStorage(uri), str(out)).catch_up()
    assert update.step == 2 and update.how == "full", update
    assert any("do not match their checksum" in r.getMessage() for r in caplog.records)
    after = read_output(str(out))
    assert after is not None and after[:2] == before[:2]
    assert after[2].keys() == want.keys()
    for k, t in want.items():
        assert torch.equal(after[2][k].view(torch.uint8), t.view(torch.uint8)), k
