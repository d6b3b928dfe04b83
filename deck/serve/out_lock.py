"""One loading service per output folder: two ``deck follow`` writing one ``--out`` would
interleave their files (one's tensors under the other's state record, Parquet folders of two
positions). The lock is an exclusive ``flock`` on a file in the folder, so the kernel drops it
when its holder dies however it dies: a killed follower never leaves its folder locked."""

from __future__ import annotations

import fcntl
import os

from deck.errors import ConfigError

LOCK_NAME = ".deck-follow.lock"


class OutLock:
    """Held from construction until :meth:`release` (or the process's end); raises
    :class:`ConfigError` naming the folder when another process holds it."""

    def __init__(self, out_dir: str):
        path = os.path.join(out_dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"--out {out_dir} is being written by another deck follow (it holds {path}); "
                "stop that one, or give this one another folder"
            ) from None
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
