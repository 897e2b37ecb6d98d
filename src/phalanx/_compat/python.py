"""CPython's private APIs phalanx relies on, each behind one function (checked on CPython 3.10 to 3.13)."""

from __future__ import annotations

import atexit
import runpy

__all__ = ["run_exit_handlers", "run_module_as_main"]


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
