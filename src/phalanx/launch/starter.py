"""How a supervisor's task comes to exist: a fresh process, or one forked from a fork server.

:class:`TaskStarter` is the part of :class:`~phalanx.launch.supervisor.Supervisor` that makes a
:class:`~phalanx.launch.root_cause.Task`'s process: its environment (the supervisor's, the task's,
the variables every child gets: ``env.SUPERVISOR_VARIABLES``, the error and done files), its
output (its log, or this terminal; ``--tee`` copies a logged task's lines here, prefixed), and the
start itself: ``spawn`` (``subprocess.Popen``, dying with its parent) or ``fork`` from a server
that imported torch once (:mod:`phalanx.launch.forkserver`), falling back to ``spawn`` for a task
that cannot be forked or when the server cannot start. :class:`ChildProcess` is a child this
process forked itself (a notebook kernel's replica), which the supervisor adopts.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO

from phalanx.errors import LaunchError
from phalanx.launch.forkserver import (
    INHERIT_VARIABLE,
    ForkedProcess,
    ForkServer,
    ProcessHandle,
    die_with_parent,
    forkable,
    inherited_server,
    preload_for,
)
from phalanx.launch.root_cause import Running, Task

__all__ = ["ChildProcess", "TaskStarter"]


class ChildProcess(ProcessHandle):
    """A child this process forked itself: the part of :class:`subprocess.Popen` a supervisor uses.

    Reaped once, under a lock: the supervisor's watcher and the program's main thread may both
    poll, and the second to ask would otherwise see "no such child" and lose the status.

    Attributes:
        pid: its process id.
        returncode: its exit code once it has ended (``-N`` when killed by signal N), else None;
            -1 if something else in this process reaped it first.
    """

    stdout = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its status is lost
                    self.returncode = -1
                else:
                    if pid != 0:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def _pause(self, seconds: float) -> None:
        time.sleep(min(seconds, 0.01))  # no one reports its end: poll often


def _child_setup(parent: int) -> None:  # runs in the child between fork and exec
    # Its own process group: a Ctrl-C at the terminal reaches the supervisor, which forwards it once.
    die_with_parent(parent, own_group=True)


class TaskStarter:
    """Starts the processes of a supervisor's tasks (see the module docstring).

    Args:
        start_method: ``spawn`` or ``fork``.
        preload: with ``fork``, modules for the server to import besides those
            :func:`~phalanx.launch.forkserver.preload_for` finds in the script.
        tee: also show every logged task's lines on this process's stdout, prefixed ``[name]``.
        run_dir: the tasks' run directory (``PHALANX_DIAGNOSIS_DIR``: where a replica writes its
            diagnosis, which the supervisor prints).
        say: how the supervisor speaks (a task started fresh instead of forked says why).
    """

    def __init__(
        self, start_method: str, preload: tuple[str, ...], tee: bool, run_dir: str | None, say: Callable[[str], None]
    ) -> None:
        self.start_method = start_method
        self.preload = preload
        self.tee = tee
        self.run_dir = run_dir
        self.say = say
        self._fork_server: ForkServer | None = None
        self._tee_lock = threading.Lock()

    @property
    def fork_server(self) -> ForkServer | None:
        """The server tasks are forked from, once one was needed."""
        return self._fork_server

    def start(self, task: Task) -> Running:
        """Starts ``task``'s process and returns its handle (the supervisor records it)."""
        inherited = {k: v for k, v in os.environ.items() if k not in task.unset}
        env = {**inherited, **task.env, "PHALANX_PARENT_PID": str(os.getpid())}  # see env.SUPERVISOR_VARIABLES
        env.pop(INHERIT_VARIABLE, None)  # this process's connection, not the task's
        if task.error_path:
            with contextlib.suppress(OSError):
                os.unlink(task.error_path)
            env["TORCHELASTIC_ERROR_FILE"] = task.error_path
        if task.done_path:
            with contextlib.suppress(OSError):
                os.unlink(task.done_path)
            env["PHALANX_DONE_FILE"] = task.done_path
        if self.run_dir:  # this supervisor prints the diagnosis a replica writes there: it need not
            env["PHALANX_DIAGNOSIS_DIR"] = self.run_dir
        piped = task.log_path is not None and self.tee
        log = None
        if task.log_path is not None:
            env["PYTHONUNBUFFERED"] = "1"  # a log read while the job runs (or after a kill) is complete
            log = open(task.log_path, "ab")  # noqa: SIM115 - the child owns it from here
        stdout = subprocess.PIPE if piped else log
        stderr = subprocess.STDOUT if log is not None else None
        try:
            server = self._server_for(task, env)
            popen: subprocess.Popen | ForkedProcess
            if server is not None:
                env["PHALANX_PARENT_PID"] = str(server.pid)  # its parent, which it watches
                popen = server.spawn(
                    task.command,
                    env=env,
                    stdout=subprocess.PIPE if piped else (log.fileno() if log is not None else None),
                    stderr=stderr,
                )
            else:
                popen = subprocess.Popen(
                    list(task.command),
                    env=env,
                    stdout=stdout,
                    stderr=stderr,
                    stdin=subprocess.DEVNULL,
                    # Not thread-safe in general (PLW1509); this one calls only
                    # async-signal-safe functions, resolved before the fork.
                    preexec_fn=functools.partial(_child_setup, os.getpid()),
                )  # noqa: PLW1509
        except BaseException:
            if log is not None:
                log.close()
            raise
        run = Running(task, popen, time.monotonic())
        if piped:
            run.pump = threading.Thread(
                target=self._pump, args=(popen.stdout, log, task.name), name=f"phalanx-tee-{task.name}", daemon=True
            )
            run.pump.start()
        elif log is not None:
            log.close()
        return run

    def _server_for(self, task: Task, env: Mapping[str, str]) -> ForkServer | None:
        """The fork server to start ``task`` from, or None to spawn it (see ``start_method``)."""
        if self.start_method != "fork":
            return None
        if self._fork_server is None or not self._fork_server.alive:  # first, or killed by someone
            preload = preload_for(task.command, extra=self.preload)
            self._fork_server = inherited_server()
            if self._fork_server is not None and not set(preload) <= set(self._fork_server.preload):
                self._fork_server.close()  # it lacks what these tasks import: one server that has it
                self._fork_server = None
            if self._fork_server is None:
                self._fork_server = ForkServer(preload, env=os.environ)
        why = forkable(task.command, env, self._fork_server.env)
        if why is not None:
            self.say(f"{task.name} starts a fresh interpreter ({why})")
            return None
        try:
            self._fork_server.start()
        except LaunchError as e:  # a job never fails for want of its fork server: start fresh
            self.say(f"{e}; replicas start fresh from here on")
            self.start_method = "spawn"
            return None
        return self._fork_server

    def close(self) -> None:
        """Ends the fork server, if one was started (call once every task has ended)."""
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = None

    def _pump(self, pipe: IO[bytes], log: IO[bytes] | None, name: str) -> None:
        """``--tee``: copies a task's output to its log, and line by line, prefixed, to stdout.

        The task's pipe is read to its end whatever happens to stdout: a reader that went away
        (``| head -1``) ends the copy to stdout only, never the task (which would get
        ``BrokenPipeError`` from a closed pipe, or block on a full one) nor its log.
        """
        prefix, partial = f"[{name}] ".encode(), b""
        out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None

        def show(data: bytes) -> None:
            nonlocal out
            if out is None:
                return
            with self._tee_lock:
                try:
                    out.write(data)
                    out.flush()
                except (OSError, ValueError):
                    out = None  # stdout is gone: the log alone from here

        try:
            while True:
                chunk = os.read(pipe.fileno(), 65536)
                if not chunk:
                    break
                if log is not None:
                    log.write(chunk)
                    log.flush()
                *lines, partial = (partial + chunk).split(b"\n")
                if lines:
                    show(b"".join(prefix + line + b"\n" for line in lines))
            if partial:
                show(prefix + partial + b"\n")
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()
            if log is not None:
                log.close()
