"""A child process that must not outlive the process that started it (a staging process, a
merger worker): the kernel ends it when its parent goes, a kill -9 included."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when the thread of process ``parent`` that
    started it ends (Linux: ``PR_SET_PDEATHSIG``; elsewhere the caller needs another way to
    notice), and exit now if ``parent`` is gone already: a child must not outlive a parent
    killed with -9."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:  # it died before the call above
        os._exit(0)
