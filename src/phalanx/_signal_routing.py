"""Keeps SIGINT and SIGTERM for the main thread, the only thread that runs Python's signal handlers.

Linux delivers a signal sent to a process (``kill PID``, an IDE's stop button, the supervisor's
SIGTERM) to any one of its threads that does not block it. When that is a helper thread (gloo's
loops, the TCP store's, phalanx's watchers), CPython's C handler only notes the signal: a main
thread blocked in ``time.sleep`` or a long C call is not woken, so a Ctrl-C sent to a sleeping
replica 0 went unnoticed for as long as the sleep lasted, with nothing printed. Threads inherit
their creator's signal mask: those started inside :func:`helper_threads_ignore_stop_signals`
block both signals, so the kernel hands them to the main thread, which is interrupted at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def helper_threads_ignore_stop_signals() -> Iterator[None]:
    """Threads (Python or native) started inside block SIGINT and SIGTERM.

    The main thread blocks them only while inside, so a signal arriving meanwhile waits and is
    handled on the way out. Start no process inside: a child would inherit the mask.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
