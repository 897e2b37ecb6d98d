"""CPython's and IPython's private APIs phalanx relies on, each behind one function (checked on
CPython 3.10 to 3.13, IPython 8.0 to 9.x)."""

from __future__ import annotations

import atexit

# Imported now, so that concurrent.futures registers its own exit hook (which shuts every thread
# pool down) before any hook of ours: those hooks run last-registered first. Imported lazily (by
# gRPC, in a server's thread) it would register after ours and run before them.
import concurrent.futures.thread  # noqa: F401
import runpy
import sys
import threading
from types import FrameType
from typing import Any, Callable

__all__ = [
    "main_thread_frame",
    "register_before_thread_pools_exit",
    "run_exit_handlers",
    "run_module_as_main",
    "set_traceback_printer",
    "show_traceback",
]


def main_thread_frame() -> FrameType | None:
    """The frame the main thread runs now, read from another thread (``sys._current_frames``,
    CPython 3.0 to 3.13); None when the main thread has ended.

    A replica's diagnosis agent answers from its heartbeat thread while the main thread sleeps,
    reads, waits in a collective or runs the user's code: this is where the main thread is.
    """
    return sys._current_frames().get(threading.main_thread().ident)


def run_exit_handlers() -> None:
    """Runs the ``atexit`` handlers now (``atexit._run_exitfuncs``, CPython 3.0 to 3.13).

    For a process that must end without the interpreter's own teardown (``os._exit``), which with
    torch loaded takes seconds and waits for non-daemon threads, but whose exit handlers (closing
    communicators, flushing logs) must still run. The handlers do not run again at exit.
    """
    atexit._run_exitfuncs()


def run_module_as_main(name: str) -> None:
    """Runs module ``name`` as ``python -m name`` does (``runpy._run_module_as_main``, CPython 3.4
    to 3.13): in the current ``__main__`` module, with ``sys.argv[0]`` set to its file.

    :func:`runpy.run_module` is not the same: it runs the module in a temporary namespace, so
    ``__main__`` is not the module's own (pickling a class defined there fails).
    """
    runpy._run_module_as_main(name, alter_argv=True)


def register_before_thread_pools_exit(fn: Callable[[], None]) -> bool:
    """Runs ``fn`` at exit before ``concurrent.futures`` shuts its thread pools down
    (``threading._register_atexit``, CPython 3.9 to 3.13); returns False where it does not exist.

    :mod:`atexit` handlers run after those pools are gone: a gRPC server still answering then
    fails noisily in its threads. Hooks run last-registered first, as :mod:`atexit`'s do.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    register(fn)
    return True


def show_traceback(shell: Any, etype: type, value: BaseException, stb: list[str]) -> None:
    """Shows ``stb`` as IPython shows a traceback (``InteractiveShell._showtraceback``, IPython
    8.0 to 9.x): the display a custom exception handler is left to do by itself."""
    shell._showtraceback(etype, value, stb)


def set_traceback_printer(shell: Any, printer: Callable[[type, BaseException, list[str]], None]) -> None:
    """Replaces how ``shell`` shows tracebacks (``InteractiveShell._showtraceback``, IPython 8.0 to
    9.x): a notebook replica prints them to its log rather than sending them to a front end."""
    shell._showtraceback = printer
