"""What a replica installs in itself so that its supervisor can report on it and never orphan it.

Called once per process when a strategy builds its communicator (:func:`install`):

* **Error file.** An uncaught exception is written to ``TORCHELASTIC_ERROR_FILE`` in torch
  elastic's format (whole or not at all), from which the supervisor names the root cause.
* **Stack dumps.** :mod:`faulthandler` on the stack-dump signal (``PHALANX_STACK_SIGNAL``, default
  SIGUSR2: ``kill -USR2 <pid>``) writes every thread's stack to stderr (the replica's log), so a
  replica still running when replica 0 has finished can say where it is. SIGUSR1 stays the
  program's (Slurm's warning before a job's time runs out).
* **Parent watch.** A daemon thread ends the process within half a second of its launcher's
  death. ``PR_SET_PDEATHSIG`` already does that for children of phalanx's supervisor; the watch
  also covers replicas that torchrun (torch elastic) started, and children whose starting thread
  is not the one that dies.
* **A quick teardown.** In a process of a launched job, once the program and the exit handlers
  registered after its first strategy have run, one collection runs (so the finalisers of what is
  garbage then run as usual) and what is left is frozen (:func:`gc.freeze`): the interpreter's
  final collections over torch's and Keras' heaps took 1.2 CPU-seconds per process with Keras
  (0.6 with torch alone) and 0.15 s after this, and replica 0 waits for the others' before its
  own. Objects still alive at exit are freed by reference counting as before; only those in
  reference cycles are left to the OS, whose ``__del__`` Python never promised to run at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import os
import signal
import sys
import threading
from typing import Any

from phalanx import config
from phalanx._signal_routing import helper_threads_ignore_stop_signals
from phalanx.launch.stdio import flush_quietly

_WATCH_PERIOD = 0.25  # seconds
_installed = False


def install() -> None:
    """Installs the three hooks above in this process, once; a no-op outside a launched job."""
    global _installed
    if _installed:
        return
    _installed = True
    install_error_recorder()
    _install_stack_dump()
    _watch_parent()
    _quick_teardown_at_exit()  # registered before the mark below, so it runs after it (LIFO)
    _mark_done_at_exit()


def _in_launched_job() -> bool:
    """Whether this process is a replica of a launched job (phalanx's, torchrun's) or replica 0 of a
    script that started its own (a notebook's kernel, whose end is the user's, is neither)."""
    if "PHALANX_PARENT_PID" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    from phalanx.launch.self_launch import current_job

    return current_job() is not None


def _quick_teardown_at_exit() -> None:
    """See the module docstring: one collection, then the survivors frozen, before the teardown."""
    if not _in_launched_job():
        return

    def quick() -> None:
        gc.collect()
        gc.freeze()

    atexit.register(quick)


def _mark_done_at_exit() -> None:
    """Tells the supervisor when the program has finished: the interpreter's own teardown (a final
    garbage collection over torch and Keras) took more than 10 s on a loaded machine, and a replica
    in it is not "still running" its program."""
    path = os.environ.get("PHALANX_DONE_FILE")
    if not path:
        return

    def mark() -> None:
        try:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass

    atexit.register(mark)  # registered now, so it runs after the communicators' handlers (LIFO)


def install_error_recorder() -> None:
    """Writes uncaught exceptions to torch elastic's error file, where the supervisor reads them."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    previous = sys.excepthook
    if getattr(previous, "_phalanx_recorder_", False):
        return

    def hook(kind, value, tb):
        # The traceback first: the supervisor acts on the error file at once, and the log's
        # tail must already hold the traceback when it reports.
        try:
            previous(kind, value, tb)
            flush_quietly(sys.stderr)
        finally:
            _record_atomically(ErrorHandler(), value)

    hook._phalanx_recorder_ = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _record_atomically(handler: Any, error: BaseException) -> None:
    """Writes elastic's error file whole or not at all.

    The supervisor reads the file as soon as the replica has exited; a replica stopped halfway
    through writing left a truncated file. So: write a temporary file in elastic's format, then
    rename it into place.
    """
    path = os.environ["TORCHELASTIC_ERROR_FILE"]
    temporary = f"{path}.{os.getpid()}.tmp"
    os.environ["TORCHELASTIC_ERROR_FILE"] = temporary
    try:
        handler.record_exception(error)
        os.replace(temporary, path)
    finally:
        os.environ["TORCHELASTIC_ERROR_FILE"] = path


def _install_stack_dump() -> None:
    if "PHALANX_PARENT_PID" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # not a launched replica: leave the user's signals alone
    if threading.current_thread() is not threading.main_thread():
        return
    sig = config.stack_signal()
    if signal.getsignal(sig) not in (signal.SIG_DFL, None):
        return  # the program handles that signal itself
    # A replica started with a closed stderr (2>&-, as plain Python allows) has nowhere to write
    # a stack: it runs without the dump rather than fail (faulthandler refuses sys.stderr None).
    with contextlib.suppress(RuntimeError, ValueError, OSError, AttributeError):
        faulthandler.register(sig, all_threads=True)


def _parent_to_watch() -> int | None:
    raw = os.environ.get("PHALANX_PARENT_PID")
    if raw and raw.isdigit():
        # Only a direct child watches: a program the replica starts inherits the variable.
        return int(raw) if os.getppid() == int(raw) else None
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # started by torchrun's agent: our parent
        return os.getppid()
    return None


def _watch_parent() -> None:
    parent = _parent_to_watch()
    if parent is None or parent <= 1:
        return

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(_WATCH_PERIOD):
            if os.getppid() != parent:
                try:
                    with contextlib.suppress(Exception):  # a closed or broken stderr: stop all the same
                        sys.stderr.write(f"phalanx: the launcher (pid {parent}) is gone; this replica stops\n")
                        sys.stderr.flush()
                finally:
                    os._exit(1)

    with helper_threads_ignore_stop_signals():  # a Ctrl-C must wake the main thread, not this one
        threading.Thread(target=watch, name="phalanx-parent-watch", daemon=True).start()
