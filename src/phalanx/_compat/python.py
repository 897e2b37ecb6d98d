"""CPython's private APIs phalanx relies on, each behind one function (checked on CPython 3.10 to 3.13)."""

from __future__ import annotations

import atexit

__all__ = ["run_exit_handlers"]


def run_exit_handlers() -> None:
    """Runs the ``atexit`` handlers now (``atexit._run_exitfuncs``, CPython 3.0 to 3.13).

    For a process that must end without the interpreter's own teardown (``os._exit``), which with
    torch loaded takes seconds and waits for non-daemon threads, but whose exit handlers (closing
    communicators, flushing logs) must still run. The handlers do not run again at exit.
    """
    atexit._run_exitfuncs()
