"""A launcher's own standard descriptors when its starter closed some (``cmd >&-``, a daemon, cron).

A process started with descriptor 1 closed has ``sys.stdout`` None, and descriptor 1 free: the
next file or socket it opens gets number 1. In a launcher that is a log file, the fork server's
control socket or a pipe, and every child started with this process's stdout would then write
into it. So a launcher's processes give a closed standard descriptor ``/dev/null``, as daemons
do, before they open anything (:func:`fill_closed`); where the process is phalanx's own (the
``phalanx`` command, the fork server) its ``sys`` streams are rebuilt over them too
(:func:`own_streams`). A program's process (self-launch's replica 0) keeps its ``sys.stdout``
None, as ``python train.py`` has it.

A replica then writes to ``/dev/null`` where a plain ``python train.py`` would have had no
stdout: what it prints is lost in both cases.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import IO

__all__ = ["closed", "fill_closed", "flush_quietly", "own_streams"]

_STREAMS = ("stdin", "stdout", "stderr")


def closed(fd: int) -> bool:
    """Whether descriptor ``fd`` is not open in this process."""
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def fill_closed() -> list[int]:
    """Opens ``/dev/null`` on each closed descriptor of 0, 1 and 2; returns those it filled."""
    filled = []
    for fd in (0, 1, 2):
        if not closed(fd):
            continue
        null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
        if null != fd:  # the lowest free number is fd (those below are open); never rely on it
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)  # os.open's descriptors are not (PEP 446); children need it
        filled.append(fd)
    return filled


def own_streams() -> None:
    """In a process of phalanx's own: :func:`fill_closed`, then ``sys.stdin``/``stdout``/``stderr``
    that are None become text streams over descriptors 0-2 (their writes go to ``/dev/null``)."""
    fill_closed()
    for fd, name in enumerate(_STREAMS):
        if getattr(sys, name) is None:
            raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
            buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
            stream = io.TextIOWrapper(
                buffered,  # type: ignore[arg-type]
                errors="backslashreplace" if fd == 2 else "strict",
                line_buffering=fd == 2,
            )
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)


def flush_quietly(*streams: IO[str] | None) -> None:
    """Flushes ``streams`` (default stdout and stderr), ignoring one that is None, closed or
    broken (a reader that went away): the launcher's own output never fails a job."""
    for stream in streams or (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):  # a program's own replacement stream included
                stream.flush()
