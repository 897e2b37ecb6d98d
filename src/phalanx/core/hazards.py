"""Process-per-replica hazards phalanx can see cheaply, each warned about once, naming the line.

Every replica is a process that runs the whole program, so a line TF ran once runs once per
replica (docs/porting.md, "Every replica runs your program"). Two such lines phalanx can see
without patching anything, through Python's audit hooks (PEP 578, ``sys.addaudithook``):

* **A directory made without** ``exist_ok=True`` (``os.mkdir``, ``os.makedirs(d)``,
  ``Path.mkdir()``): the replicas race, and every one but the first raises ``FileExistsError``
  (the keras.io guide's ``if not os.path.exists(d): os.makedirs(d)`` fails one run in several);
* ``input()``: every replica asks, and only the chief has the terminal.

Each is a :class:`ProcessHazardWarning`, once per source line, on every replica of a job of more
than one process (the chief's shows on the terminal, the others' in their logs). Calls from
libraries (the standard library, site-packages, phalanx) are not the program's and are ignored.
The hook costs one string comparison per audited event and is installed once, by the first
strategy that spans several processes (an audit hook cannot be removed; it does nothing while no
such strategy is alive).

Example::

    os.makedirs("out")                # warns: ProcessHazardWarning naming this line
    os.makedirs("out", exist_ok=True)  # the safe idiom: no warning
"""

from __future__ import annotations

import os
import pathlib
import sys
import sysconfig
import threading
import warnings
from types import FrameType
from typing import Callable

_INSTALLED = False
_SEVERAL_PROCESSES: list[Callable[[], bool]] = []  # set by install(): whether a live job spans processes
_LOCK = threading.Lock()
_WARNED: set[tuple[str, str, int]] = set()
_LIBRARY_ROOTS = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # phalanx itself
)
_MAKEDIRS = os.makedirs.__code__
_PATH_MKDIR = pathlib.Path.mkdir.__code__


class ProcessHazardWarning(UserWarning):
    """A line every replica runs that behaves differently when every replica is a process."""


def install(several_processes: Callable[[], bool]) -> None:
    """Adds the audit hook (once per process; called by a strategy spanning several processes).

    Args:
        several_processes: whether this process is now part of a job of several processes (a live
            strategy spans them); the hook does nothing while it says no.
    """
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
        _SEVERAL_PROCESSES[:] = [several_processes]
    sys.addaudithook(_audit)


def _audit(event: str, args: tuple) -> None:
    if event != "os.mkdir" and event != "builtins.input":
        return
    try:
        _check(event, args)
    except Exception:  # noqa: BLE001 - an audit hook must never break the call it watches
        pass


def _several_processes() -> bool:
    return bool(_SEVERAL_PROCESSES) and _SEVERAL_PROCESSES[0]()


def _check(event: str, args: tuple) -> None:
    if not _several_processes():
        return
    # _audit's caller, without holding this frame: ``frame = inspect.currentframe()`` would make a
    # cycle through this frame that keeps the whole calling stack (a thread's, often) alive until
    # a garbage collection, and a replica forked meanwhile that collects it crashed (SIGSEGV).
    caller: FrameType | None = sys._getframe(2)
    try:
        _check_from(event, args, caller)
    finally:
        del caller


def _check_from(event: str, args: tuple, caller: FrameType | None) -> None:
    if event == "os.mkdir":
        caller = _past_exist_ok_callers(caller)
        if caller is None or _in_library(caller):
            return
        _warn_once(
            caller,
            f"every replica runs this line, so the replicas race to make directory {os.fspath(args[0])!r} and all "
            "but the first raise FileExistsError",
            "os.makedirs(path, exist_ok=True) (or Path.mkdir(parents=True, exist_ok=True)) on every replica",
        )
    elif not _in_library(caller):
        _warn_once(
            caller,
            "every replica runs this input(), and only the chief has the terminal: the others wait or read nothing",
            "ask on the chief (`if phalanx.is_chief():`) and send the answer to the other replicas "
            "(strategy.extended.broadcast, or a file written before phalanx.barrier())",
        )


def _past_exist_ok_callers(frame: FrameType) -> FrameType | None:
    """The program's frame that made the directory, or None when it asked for ``exist_ok=True``."""
    while frame is not None and frame.f_code in (_MAKEDIRS, _PATH_MKDIR):
        if frame.f_locals.get("exist_ok"):
            return None
        outer = frame.f_back
        # makedirs calls itself for the parents: the outermost call is the program's.
        while outer is not None and outer.f_code is frame.f_code:
            if outer.f_locals.get("exist_ok"):
                return None
            frame, outer = outer, outer.f_back
        frame = outer
    return frame


def _in_library(frame: FrameType) -> bool:
    path = os.path.realpath(frame.f_code.co_filename)
    return path.startswith(_LIBRARY_ROOTS) or frame.f_code.co_filename.startswith("<frozen")


def _warn_once(frame: FrameType, problem: str, fix: str) -> None:
    key = (problem.split(",")[0], frame.f_code.co_filename, frame.f_lineno)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn_explicit(
        f"{problem}. Safe: {fix} (docs/porting.md, 'Every replica runs your program').",
        ProcessHazardWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__", "__main__"),
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
    )


def reset_for_tests() -> None:
    """Forgets which lines were warned about (the hook stays installed)."""
    _WARNED.clear()
