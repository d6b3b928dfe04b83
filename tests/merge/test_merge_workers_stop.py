"""``deck merge --follow --workers K`` stops its worker processes with itself: on SIGTERM (what
kill, systemd and Kubernetes send) it stops them and exits 0, and killed with -9 its workers
end too (a break-it finding: SIGTERM left K workers and the resource tracker merging for ever,
children of init, holding the caller's pipes open)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deck.storage import open_storage
from deck.testing.procfs import exited
from deck.testing.synth import SynthTrainer

EXE = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def _signal_mask(pid: int, field: str) -> int:
    """A signal set of ``/proc/PID/status`` (``SigCgt``, ``SigIgn``, ...); 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    line = next(line for line in status.splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1], 16)


def _catches_sigterm(pid: int) -> bool:
    return bool(_signal_mask(pid, "SigCgt") & SIGTERM_BIT)


def _until(done: object, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _merge_follow(uri: str, *extra: str, **popen: Any) -> subprocess.Popen[str]:
    """`deck merge URI --follow --workers 2`, polling often, its output piped."""
    return subprocess.Popen(
        [EXE, "merge", uri, "--follow", "--workers", "2", "--poll", "0.05", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@contextlib.contextmanager
def _running(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``proc``, killed on the way out if a failed assertion left it running."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def _following(proc: subprocess.Popen[str]) -> set[int]:
    """The worker processes of ``proc`` that follow (their SIGTERM handler is installed)."""
    assert proc.poll() is None, proc.communicate()
    return {c for c in _children(proc.pid) if _catches_sigterm(c)}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_merge_workers_end_with_their_command(tmp_path: Path, how: str) -> None:
    uri = str(tmp_path / "ck")
    tr = SynthTrainer(open_storage(uri))
    tr.save("full")
    for _ in range(6):
        tr.train()
        tr.save("delta")
    with _running(_merge_follow(uri, "--stride", "2")) as proc:
        _until(lambda: len(_following(proc)) >= 2, "the workers did not start following")
        descendants = _children(proc.pid)
        os.kill(proc.pid, getattr(signal, how))
        stdout, stderr = proc.communicate(timeout=120)
    if how == "SIGTERM":
        assert proc.returncode == 0, stdout + stderr
        assert "deck merge:" in stdout and "Traceback" not in stderr, stdout + stderr
    _until(lambda: all(exited(p) for p in descendants), f"left running: {descendants}")
    # (its workers spoke through one multiprocessing queue: killed with -9, its resource
    # tracker said "leaked semaphore objects"; a pipe per worker leaves nothing to track)
    assert "leaked" not in stderr and "resource_tracker" not in stderr, stderr


def test_a_stop_signal_landing_inside_the_wait_sets_the_event() -> None:
    """A break-it finding: a --follow worker's SIGTERM handler called ``stop.set()``; landing
    while the main thread held the event's lock (inside ``stop.wait()``), it waited on itself
    for ever, and its parent on it. The handler takes no lock now: a thread sets the event."""
    import threading

    from deck.cli.stopping import stop_on_signals

    before = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    with stop_on_signals(stop):
        with stop._cond:  # where stop.wait() holds it, and set() takes it
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # (the handler runs between two of these bytecodes)
                pass
            assert not stop.is_set()  # (the thread that sets it waits for the lock)
        assert stop.wait(120)
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_killed_is_started_again_and_merging_goes_on(tmp_path: Path) -> None:
    """A break-it finding: one of `deck merge --follow --workers 2`'s workers killed with -9,
    the other waited for its partitions for ever ("waiting for other workers", at INFO) and
    nothing was merged again, while the command ran on without a word. The command starts it
    again (said at WARNING), merging goes on, and SIGTERM still ends it with exit 0."""
    from deck.read.catalog import read_manifests

    uri = str(tmp_path / "ck")
    storage = open_storage(uri)
    tr = SynthTrainer(storage)
    tr.save("full")
    with _running(_merge_follow(uri, "--stride", "2")) as proc:
        _until(lambda: len(_following(proc)) >= 2, "the workers did not start following")
        first = _following(proc)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        _until(
            lambda: len(_following(proc) - first) == 1 and victim not in _following(proc),
            "the killed worker was not started again",
        )
        for _ in range(6):  # work only both workers together can merge
            tr.train()
            tr.save("delta")
        _until(
            lambda: bool(read_manifests(storage).merged),
            "nothing was merged after the kill",
        )
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr
    assert re.search(
        r"worker \d was killed by SIGKILL without a word; starting it again in 1 s", stderr
    ), stderr


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stopped_while_its_workers_start_it_exits_0(tmp_path: Path) -> None:
    """A break-it finding: SIGTERM to `deck merge --follow --workers 2`'s process group while
    its workers were still starting (before their handler) killed them, and the command exited
    2 with no word of why. A worker starts with the stop signals blocked and takes one that
    came meanwhile as a stop once it can: exit 0, as for a stop later on."""
    uri = str(tmp_path / "ck")
    tr = SynthTrainer(open_storage(uri))
    tr.save("full")
    with _running(_merge_follow(uri, start_new_session=True)) as proc:
        _until(
            lambda: proc.poll() is None and _catches_sigterm(proc.pid) and _children(proc.pid),
            "the workers were not started",
        )
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr
    assert "Traceback" not in stderr and "without finishing" not in stderr, stderr


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_started_ignoring_sigint_its_workers_ignore_it_too_and_a_stop_after_a_death_is_0(
    tmp_path: Path,
) -> None:
    """Two break-it findings. Started in a shell's background (SIGINT ignored), the command
    ignored a group's SIGINT while its workers stopped on it, and it started them again for
    ever, "stopped alone": they ignore it as their command does. And SIGTERM right after a
    worker died exited 2: a stop of the service is exit 0 whatever died before it."""
    uri = str(tmp_path / "ck")
    tr = SynthTrainer(open_storage(uri))
    tr.save("full")
    with _running(_merge_follow(uri, start_new_session=True, preexec_fn=_ignore_sigint)) as proc:
        _until(lambda: len(_following(proc)) >= 2, "the workers did not start following")
        sigint = 1 << (signal.SIGINT - 1)
        workers = _following(proc)
        assert all(_signal_mask(w, "SigIgn") & sigint for w in [proc.pid, *workers]), workers
        os.killpg(proc.pid, signal.SIGINT)  # (ignored by all: nothing to see)
        os.kill(min(workers), signal.SIGKILL)
        os.kill(proc.pid, signal.SIGTERM)  # at once: the death may not have been seen yet
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr
    assert "stopped alone" not in stderr and "Traceback" not in stderr, stderr
    assert "SIGINT is ignored" in stderr and "stop it with SIGTERM" in stderr, stderr
