"""Loader children for kill tests: a small fork server with no Kafka client of its own.

Forking the test process is not safe once it has librdkafka handles (a publisher's producer):
the children then crashed with SIGSEGV in about 1 of 20 forks. This server is a fresh Python
(``python -m deck.testing.kafka_child``) that imports deck and creates no Kafka client; for
each request (one JSON line on stdin: the loader's keyword arguments, the failpoint spec, a
marker path) it forks a child that arms the failpoints, runs ``KafkaFollower(**kwargs)
.catch_up()`` and exits; it answers with JSON lines: ``{"pid": N}`` at once, then ``{"signal":
S | null, "code": C | null}`` when the child ended. Requests and answers are JSON (no pickle).

:class:`LoaderChildren` is the test side (a context manager).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import IO, Any


def loader_from(kwargs: dict[str, Any]) -> Any:
    """A ``KafkaFollower`` from plain (JSON-able) arguments: ``full_uri`` is opened as its
    ``full_store``, the rest is passed as given."""
    from deck.serve.kafka_follow import KafkaFollower
    from deck.storage import open_storage

    kw = dict(kwargs)
    full_uri = kw.pop("full_uri", None)
    return KafkaFollower(**kw, full_store=None if full_uri is None else open_storage(full_uri))


def _child(req: dict[str, Any]) -> int:  # pragma: no cover - runs in a forked child
    from deck import failpoints

    try:
        os.environ[failpoints.MARKER_ENV] = req["marker"]
        failpoints.configure(req["spec"])
        kf = loader_from(req["kwargs"])
        try:
            kf.catch_up()
        finally:
            kf.close()
        return 0
    except BaseException:
        with open(req["err"], "w") as f:
            f.write(traceback.format_exc())
        return 3


def serve(stdin: IO[str], stdout: IO[str]) -> None:
    """The server loop (see the module doc)."""
    import deck.serve.kafka_follow  # noqa: F401  (imported once here, before any fork)

    for line in stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(_child(req))
        stdout.write(json.dumps({"pid": pid}) + "\n")
        stdout.flush()
        _, status = os.waitpid(pid, 0)
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        stdout.write(json.dumps({"signal": sig, "code": code}) + "\n")
        stdout.flush()


class LoaderChildren:
    """Runs loaders in children of a clean fork server, killed by failpoints."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> LoaderChildren:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "deck.testing.kafka_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)

    def _line(self, deadline: float) -> dict[str, Any] | None:
        assert self._proc is not None and self._proc.stdout is not None
        out = self._proc.stdout
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([out], [], [], left)[0]:
            return None
        line = out.readline()
        if not line:
            raise RuntimeError("the loader fork server died")
        return dict(json.loads(line))

    def run(
        self, kwargs: dict[str, Any], spec: str, timeout_s: float = 120.0
    ) -> tuple[str, str | None]:
        """Run ``KafkaFollower(**kwargs).catch_up()`` in a child with failpoints ``spec``
        armed. Returns ``("killed", "point:nth")`` when a failpoint SIGKILLed it,
        ``("finished", None)``, ``("error", traceback)`` (an exception, or another signal),
        or ``("hung", None)`` after ``timeout_s`` (then it is killed: a loader must never
        hang)."""
        assert self._proc is not None and self._proc.stdin is not None
        fd, marker = tempfile.mkstemp(prefix="deck-failpoint-")
        os.close(fd)
        os.remove(marker)
        fd, err = tempfile.mkstemp(prefix="deck-child-err-")
        os.close(fd)
        req = {"kwargs": kwargs, "spec": spec, "marker": marker, "err": err}
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        try:
            started = self._line(deadline)
            if started is None:
                raise RuntimeError("the loader fork server does not answer")
            done = self._line(deadline)
            if done is None:
                os.kill(int(started["pid"]), signal.SIGKILL)
                self._line(time.monotonic() + 30)
                return "hung", None
            if done["signal"] == signal.SIGKILL and os.path.exists(marker):
                with open(marker) as f:
                    return "killed", f.read().strip()
            if done["signal"] is None and done["code"] == 0:
                return "finished", None
            with open(err) as f:
                return "error", f"signal {done['signal']}, exit code {done['code']}: {f.read()}"
        finally:
            for p in (marker, err):
                if os.path.exists(p):
                    os.remove(p)


if __name__ == "__main__":  # pragma: no cover - the server process
    serve(sys.stdin, sys.stdout)
