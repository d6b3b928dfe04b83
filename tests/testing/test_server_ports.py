"""The test servers' port checks (deck.testing.s3_server): two test processes may pick the same
free port, so a server started on one waits for its own listener, never another process's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from deck.testing.s3_server import free_ports, listening


def test_a_listener_is_told_apart_from_another_processs_on_the_same_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not listening(os.getpid(), port)  # bound, not listening yet
        s.listen()
        assert listening(os.getpid(), port)
        # Another process on this machine (a server that failed to bind this port) does not.
        other = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        try:
            assert not listening(other.pid, port)
        finally:
            other.communicate(b"")
    (free,) = free_ports(1)
    assert not listening(os.getpid(), free)
