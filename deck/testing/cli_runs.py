"""Independent command-line runs started together (each ``deck`` run spends seconds importing
torch; tests that check several read-only commands on one store wait for them once)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K")


def run_at_once(
    argvs: Mapping[K, Sequence[str]],
    *,
    preexec_fn: Callable[[], None] | None = None,
    timeout: float = 300,
) -> dict[K, subprocess.CompletedProcess[str]]:
    """Each argv run as its own process, all started before any is waited for; their results
    by the same keys. Only for runs that do not depend on each other's effects."""
    procs = {
        key: subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,
        )
        for key, argv in argvs.items()
    }
    done = {}
    for key, p in procs.items():
        stdout, stderr = p.communicate(timeout=timeout)
        done[key] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return done
