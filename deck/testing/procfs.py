"""What Linux's /proc says of a process, for tests that kill processes and wait for them."""

from __future__ import annotations

from pathlib import Path


def process_state(pid: int, tid: int | None = None) -> str | None:
    """The fields of ``/proc/pid/stat`` after the command name (``[0]`` is the state letter,
    ``"Z"`` for a zombie), of thread ``tid`` if given; None once it is gone. A process reaped
    between the open and the read raises ESRCH, not ENOENT: both mean gone."""
    path = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rpartition(")")[2]


def exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (its sockets and pipes are closed), reaped or not."""
    state = process_state(pid)
    return state is None or state.split()[0] == "Z"
