"""A few shared integers through which the processes of a session agree on where to stop.

Word 0 is the *stop step* (0: none), written by replica 0 when the user interrupts; word
``1 + r`` is how many strategy steps replica ``r`` has started in the current cell, written only
by replica ``r``. Single writers and aligned 8-byte words need no locks. A forked replica
inherits the anonymous mapping; a spawned one maps a small file in the session's log folder
(not ``/dev/shm``), removed when the session closes.
"""

from __future__ import annotations

import mmap
import os


class Control:
    """The session's shared words."""

    def __init__(self, world_size: int, path: str | None = None, create: bool = True) -> None:
        self.world_size = world_size
        self.path = path
        size = max(mmap.PAGESIZE, 8 * (1 + world_size))
        if path is None:
            self._mm = mmap.mmap(-1, size)  # MAP_SHARED | MAP_ANONYMOUS: shared with forked children
        else:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
            try:
                if create:
                    os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self._words = memoryview(self._mm).cast("q")

    @property
    def stop(self) -> int:
        return self._words[0]

    @stop.setter
    def stop(self, step: int) -> None:
        self._words[0] = step

    def set_steps(self, rank: int, steps: int) -> None:
        self._words[1 + rank] = steps

    def steps(self) -> list[int]:
        return [self._words[1 + r] for r in range(self.world_size)]

    def reset(self) -> None:
        for i in range(1 + self.world_size):
            self._words[i] = 0

    def remove(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
