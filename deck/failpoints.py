"""Named crash points: a TEST HOOK for crash-consistency and disk-full tests.

deck's write paths call :func:`failpoint` with a name at the moments a crash matters
(``"stager.spool.after_write"``, ``"commit.before_manifest"``, ...). Nothing happens unless
the process was started with ``DECK_FAILPOINTS`` naming that point::

    DECK_FAILPOINTS="stager.upload.after_put:3"            # SIGKILL on the 3rd hit
    DECK_FAILPOINTS="stager.spool.before_write:2:enospc"   # 2nd hit raises OSError(ENOSPC)
    DECK_FAILPOINTS="stager.spool.before_write:2+:enospc"  # ... and every later hit too
    DECK_FAILPOINTS="a:1,b:4"                              # several points

Spec: ``name[:nth[+]][:action]``; ``nth`` counts hits of that name in this process from 1
(default 1); ``action`` is ``kill`` (default: ``os.kill(os.getpid(), SIGKILL)``, nothing after
it runs, no cleanup, like ``kill -9``; hit in a staging process of
``StagingConfig(mode="process")``, its training process is killed first: the rank dies there, as
with the staging threads), ``kill-self`` (SIGKILL only the process that hits it: a staging
process dies alone and its training process goes on), ``enospc`` (raise ``OSError(ENOSPC)`` as a full disk
would) or ``interrupt`` (raise ``KeyboardInterrupt``, as a Ctrl-C landing there would). With ``DECK_FAILPOINT_MARKER=<path>`` a killed process first creates ``<path>``
holding the point's name and hit (``name:nth``; ``name:nth staging`` when a staging process hit
it), so a test knows the kill happened there and nowhere else. A staging process's own hit
counts are asked with ``ProcessStager.failpoint_hits()``: how a test enumerates the points it
passes.

The environment is parsed once, at import; :func:`configure` re-arms (a test's forked child).
Disarmed, a call is one lookup in an empty dict. Never set these variables in production.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

ENV = "DECK_FAILPOINTS"
MARKER_ENV = "DECK_FAILPOINT_MARKER"
ACTIONS = ("kill", "kill-self", "enospc", "interrupt")
STAGING = "staging"  # how a marker says a staging process hit the point


@dataclass
class _Point:
    nth: int
    repeat: bool
    action: str
    hits: int = 0


_armed: dict[str, _Point] = {}
_lock = threading.Lock()
_kill_first: int | None = None  # a staging process: its training process, killed first
_watchers: list[Callable[[str], None]] = []  # told each new spec (staging processes)


def parse(spec: str) -> dict[str, tuple[int, bool, str]]:
    """``name -> (nth, repeat, action)`` of a ``DECK_FAILPOINTS`` value; ValueError if malformed."""
    out: dict[str, tuple[int, bool, str]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, *rest = item.split(":")
        if not name or len(rest) > 2:
            raise ValueError(f"{ENV}: bad failpoint {item!r}; use name[:nth[+]][:action]")
        nth_s = rest[0] if rest else "1"
        repeat = nth_s.endswith("+")
        nth = int(nth_s.rstrip("+"))
        action = rest[1] if len(rest) > 1 else "kill"
        if nth < 1 or action not in ACTIONS:
            raise ValueError(f"{ENV}: bad failpoint {item!r}; nth >= 1, action in {ACTIONS}")
        out[name] = (nth, repeat, action)
    return out


def configure(spec: str | None) -> None:
    """Arm exactly the points of ``spec`` (None or "" disarms all); hit counts restart at 0.
    The staging processes of this process are armed the same way (their counts restart too)."""
    with _lock:
        _armed.clear()
        for name, (nth, repeat, action) in parse(spec or "").items():
            _armed[name] = _Point(nth, repeat, action)
        watchers = list(_watchers)
    for tell in watchers:
        tell(spec or "")


def watch(tell: Callable[[str], None]) -> Callable[[], None]:
    """Call ``tell(spec)`` at every :func:`configure` from now on; returns how to stop."""
    with _lock:
        _watchers.append(tell)

    def stop() -> None:
        with _lock:
            if tell in _watchers:
                _watchers.remove(tell)

    return stop


def spec() -> str:
    """The armed points as a ``DECK_FAILPOINTS`` value (hit counts not included): what a staging
    process is armed with when it starts."""
    with _lock:
        return ",".join(
            f"{name}:{p.nth}{'+' if p.repeat else ''}:{p.action}" for name, p in _armed.items()
        )


def kill_first(pid: int | None) -> None:
    """In a staging process: a ``kill`` kills the training process ``pid`` first."""
    global _kill_first
    _kill_first = pid


def armed() -> list[str]:
    """Names of the armed points."""
    return sorted(_armed)


def hits() -> dict[str, int]:
    """How often each armed point was reached since it was armed (fired or not): a test arms
    points with an unreachable ``nth`` in a probe run to learn which hits a real run can be
    killed at."""
    with _lock:
        return {name: point.hits for name, point in _armed.items()}


def failpoint(name: str, path: str | None = None) -> None:
    """Crash point ``name``; ``path`` is the file an ``enospc`` error names. No-op unless armed."""
    point = _armed.get(name)
    if point is None:
        return
    with _lock:
        point.hits += 1
        fire = point.hits == point.nth or (point.repeat and point.hits > point.nth)
    if not fire:
        return
    if point.action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    if point.action == "interrupt":
        raise KeyboardInterrupt(name)
    marker = os.environ.get(MARKER_ENV)
    if marker:
        where = "" if _kill_first is None else f" {STAGING}"
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, f"{name}:{point.nth}{where}\n".encode())
        os.close(fd)
    if point.action == "kill" and _kill_first is not None:
        os.kill(_kill_first, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


configure(os.environ.get(ENV))
