"""The one supervisor under every launcher: start tasks, watch them, stop them, name the root cause.

Self-launch (``python train.py`` with a multi-replica strategy), ``phalanx run -n N``, the
parameter-server cluster (``phalanx run --ps P --workers W``) and notebook sessions
(:mod:`phalanx.interactive.session`: spawned replicas started here, forked ones adopted with
:meth:`Supervisor.adopt`) are configurations of this module, as torchrun and horovodrun are
configurations of their single cores. What they share:

* **Tasks.** A :class:`Task` is a name, a command, the environment it adds and where its output
  goes. A task with no ``log_path`` writes straight to this process's terminal (replica 0, the
  chief): its output is byte for byte what ``python train.py`` prints, Keras progress bars
  included. The others write to ``LOGDIR/<run-id>/<task>.log``
  (:class:`~phalanx.launch.run_dir.RunDirectory`);
  ``tee=True`` also shows every task's lines on the terminal, prefixed with its name.
* **Die with the parent.** Every child gets ``PR_SET_PDEATHSIG`` (SIGKILL) from the kernel when
  the thread that started it ends, and a parent watch (:mod:`phalanx.launch.replica_hooks`) once
  it runs phalanx: ``kill -9`` of a launcher leaves no replica behind. A task forked from a fork
  server (``start_method="fork"``, :mod:`phalanx.launch.forkserver`) dies with the server, which
  dies with the supervisor.
* **Signals.** Children run in their own process group, so a Ctrl-C at the terminal reaches the
  supervisor alone, which forwards it once to every task (:meth:`Supervisor.stop`: the signal,
  a grace period, then SIGKILL).
* **One root-cause format** (:func:`~phalanx.launch.root_cause.root_cause`), after torch elastic's
  ``ChildFailedError``: the first failure across tasks, with the error its process recorded in torch
  elastic's error-file format (``TORCHELASTIC_ERROR_FILE``) and the tail of its log. A task that
  only lost a peer, or that the supervisor itself stopped, is never the cause when another failure
  is there; when the first failure seen is such a consequence, the supervisor waits (briefly,
  :data:`CAUSE_WAIT_S`) for the failure it followed before it stops anything or reports
  (:meth:`Supervisor.await_cause`). When no other failure comes, a task that a peer's
  ``CollectiveTimeoutError`` waited for, alive until the supervisor stopped it, is the cause: named
  as stalled, with its state then (stopped by SIGSTOP or a debugger, or running) and the error of
  the peer that waited.

Example::

    >>> import sys
    >>> sup = Supervisor()
    >>> run = sup.start(Task(name="hello", command=(sys.executable, "-c", "print('hi')"), log_path=None))
    >>> sup.wait(run, timeout=30)
    0

The concerns around the loop live beside it: run directories and logs
(:mod:`phalanx.launch.run_dir`), the task records and the root cause
(:mod:`phalanx.launch.root_cause`), and how a launcher's job ends on a signal or after replica 0
(:mod:`phalanx.launch.job_end`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import IO

from phalanx.comm import diagnosis
from phalanx.errors import LaunchError
from phalanx.launch import settings
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
from phalanx.launch.root_cause import (
    Exit,
    Running,
    Task,
    diagnosed_cause,
    format_failure,
    is_consequence,
    read_error,
    root_cause,
)

__all__ = ["CAUSE_WAIT_S", "ChildProcess", "Supervisor"]

FAILING_GRACE_S = 0.5  # a task that recorded its error gets this long to finish exiting by itself
# A failure that is only a consequence waits at most this long for the one it followed to show: the
# peer that failed first is often still exiting (its teardown can take seconds), or its end not yet
# reported (a fork server reports an exit a moment after the process ended).
CAUSE_WAIT_S = 2.0
# A replica diagnosing a failed collective (its peers' answers, then diagnosis.json) gets this long
# before it is stopped; after a task was killed by a signal, its peers get DIAGNOSIS_SETTLE_S to start.
DIAGNOSIS_WAIT_S = 3.0
DIAGNOSIS_SETTLE_S = 0.3


# ----------------------------------------------------------------------------- the supervisor
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


class Supervisor:
    """Starts tasks, watches them and stops them; the three launchers are configurations of it.

    Args:
        tee: also show every logged task's lines on this process's stdout, prefixed ``[name]``.
        out: where the supervisor's own messages go (default stderr).
        start_method: ``spawn`` (each task a fresh ``exec``) or ``fork`` (Python tasks forked from
            a server that imported torch once: :mod:`phalanx.launch.forkserver`; a task that
            cannot be forked is spawned).
        preload: with ``fork``, modules for the server to import besides those
            :func:`~phalanx.launch.forkserver.preload_for` finds in the script.
        run_dir: the tasks' run directory, where a replica whose collective failed writes its
            diagnosis (:mod:`phalanx.comm.diagnosis`); the root-cause report prints it.
    """

    def __init__(
        self,
        *,
        tee: bool = False,
        out: IO[str] | None = None,
        start_method: str = "spawn",
        preload: Sequence[str] = (),
        run_dir: str | None = None,
    ) -> None:
        if start_method not in ("spawn", "fork"):
            raise ValueError(f"start_method must be 'spawn' or 'fork', not {start_method!r}")
        self.tee = tee
        self.start_method = start_method
        self.preload = tuple(preload)
        self._fork_server: ForkServer | None = None
        self._out = out
        self._runs: list[Running] = []
        self._exits: list[Exit] = []
        self._cause_reported = False  # this attempt printed a root cause: it failed (job_status)
        # Where the tasks' run directory is (their logs, and a diagnosis a replica wrote there).
        self.run_dir = run_dir
        self._attempt_started = time.time()
        self._lock = threading.Lock()
        self._tee_lock = threading.Lock()

    # ------------------------------------------------------------------ messages
    def say(self, text: str) -> None:
        """Prints a supervisor message (prefixed ``phalanx:``)."""
        out = self._out or sys.stderr
        with contextlib.suppress(Exception):
            out.write(f"phalanx: {text.rstrip()}\n")
            out.flush()

    # ------------------------------------------------------------------ starting
    def start(self, task: Task) -> Running:
        """Starts ``task`` (again, for a restart) and returns its handle."""
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
        with self._lock:
            self._runs = [r for r in self._runs if r.task.name != task.name] + [run]
        return run

    def adopt(self, task: Task, pid: int) -> Running:
        """Watches ``pid``, a child this process forked itself, as one of its tasks.

        For a replica that must go on from this process's own state (a notebook kernel's, forked
        mid-program), which no command can start: from here the supervisor reaps, signals and
        reports it like the tasks it started (``task.command`` is empty).
        """
        run = Running(task, ChildProcess(pid), time.monotonic())
        with self._lock:
            self._runs = [r for r in self._runs if r.task.name != task.name] + [run]
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

    # ------------------------------------------------------------------ watching
    @property
    def runs(self) -> list[Running]:
        with self._lock:
            return list(self._runs)

    def alive(self) -> list[Running]:
        return [r for r in self.runs if r.popen.poll() is None]

    def failing(self) -> list[Running]:
        """Tasks that recorded an uncaught exception and have not exited yet (see :meth:`poll`)."""
        return [r for r in self.alive() if r.failed_at is not None]

    def poll(self) -> list[Exit]:
        """The tasks that ended since the last call, in the order they were seen ending."""
        ended = []
        with self._lock:
            runs = list(self._runs)
        for run in runs:
            code = run.popen.poll()
            if code is None:
                # A replica records its uncaught exception before it tears down (which can take
                # seconds): that is when it fails, for the purpose of stopping the job.
                _note_recorded_error(run)
                continue
            if run.pump is not None:
                run.pump.join(timeout=2)
            message, timestamp = read_error(run.task.error_path) if code != 0 else ("", int(time.time()))
            if run.failed_at is not None and code == 0:
                code = 1  # it recorded an error, then exited 0 (sys.exit(0) in a finally, say)
            with self._lock:
                if run not in self._runs:
                    continue
                self._runs.remove(run)
                exit = Exit(
                    run.task,
                    run.pid,
                    code,
                    len(self._exits),
                    run.stopped_by_supervisor,
                    message,
                    timestamp,
                    run.failed_at is not None and code < 0,
                    state_when_stopped=run.state_when_stopped,
                )
                self._exits.append(exit)
            ended.append(exit)
        return ended

    def record(self, task: Task, pid: int, code: int, message: str) -> Exit:
        """Counts the end of a process that this supervisor does not run among the job's exits.

        Self-launch's replica 0 is the launching process itself: its own failure takes part in
        :meth:`await_cause` and in the root cause like any task's.
        """
        with self._lock:
            exit = Exit(task, pid, code, len(self._exits), False, message, int(time.time()))
            self._exits.append(exit)
        return exit

    def cause_known(self) -> bool:
        """Whether a failure that is not a consequence has been seen, or can no longer come.

        That is: an exit that is not a consequence; a task still exiting that recorded an error
        that is not one; or no task left running.
        """
        if any(e.failed and not e.consequence for e in self.exits):
            return True
        alive = self.alive()
        return not alive or any(
            r.failed_at is not None and not is_consequence(read_error(r.task.error_path)[0]) for r in alive
        )

    def await_cause(self, timeout: float = CAUSE_WAIT_S) -> list[Exit]:
        """After a failure: waits, at most ``timeout`` seconds, until :meth:`cause_known`.

        A task that only lost a peer fails at once, while the peer whose error it follows may still
        be exiting; stopping the job then would kill that peer before it records its error (and
        count it as stopped by us), and a report would name the consequence. Returns at once when
        the cause is known; never waits more than ``timeout``.

        Returns:
            The exits seen meanwhile.
        """
        deadline = time.monotonic() + timeout
        seen: list[Exit] = []
        while True:
            seen += self.poll()
            if self.cause_known() or time.monotonic() >= deadline:
                return seen
            time.sleep(0.02)

    def await_diagnosis(self, limit: float = DIAGNOSIS_WAIT_S, settle: float = DIAGNOSIS_SETTLE_S) -> list[Exit]:
        """Before the others are stopped: lets a replica that is diagnosing the failure finish.

        A replica whose collective failed asks every replica where it is, then writes the diagnosis
        to the run directory (:mod:`phalanx.comm.diagnosis`); meanwhile a marker says so. Stopping it
        then would lose the diagnosis. Waits while a marker is there, at most ``limit`` seconds;
        after a task killed by a signal (a crash, the OOM killer: its peers notice within a tenth of
        a second, and their view of where they were is all there is) first ``settle`` seconds for
        one to start. Returns at once where no run directory is kept.

        Returns:
            The exits seen meanwhile.
        """
        if not self.run_dir:
            return []
        seen: list[Exit] = []
        start = time.monotonic()
        killed = any(e.code < 0 and not e.stopped_by_supervisor for e in self.exits)
        while self.alive() and time.monotonic() - start < limit:
            if not diagnosis.pending(self.run_dir) and (not killed or time.monotonic() - start >= settle):
                break
            time.sleep(0.02)
            seen += self.poll()
        return seen

    def forget_exits(self) -> None:
        """Starts a new attempt: earlier ends (and an earlier diagnosis) no longer count for the root cause."""
        with self._lock:
            self._exits = []
            self._cause_reported = False
            self._attempt_started = time.time()

    @property
    def exits(self) -> list[Exit]:
        """Every task end seen so far."""
        with self._lock:
            return list(self._exits)

    def wait(self, run: Running, timeout: float | None = None) -> int | None:
        """Waits for one task; its exit code, or None if it still runs after ``timeout``."""
        try:
            return run.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_any(self, runs: Sequence[Running], timeout: float, period: float = 0.05) -> bool:
        """Waits until every one of ``runs`` has ended (True) or ``timeout`` passed (False)."""
        deadline = time.monotonic() + timeout
        while any(r.popen.poll() is None for r in runs):
            if time.monotonic() >= deadline:
                return False
            time.sleep(period)
        return True

    # ------------------------------------------------------------------ stopping
    def signal_all(self, sig: int, runs: Sequence[Running] | None = None) -> None:
        """Sends ``sig`` to every running task (each in its own process group)."""
        for run in runs if runs is not None else self.alive():
            _note_stopped(run)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(run.pid, sig)

    def stop(
        self,
        sig: int = signal.SIGTERM,
        grace: float | None = None,
        *,
        runs: Sequence[Running] | None = None,
        end_teardown: bool = False,
    ) -> None:
        """Signal forwarding: ``sig`` to every task, ``grace`` seconds, then SIGKILL to what is left.

        Args:
            end_teardown: SIGKILL a task as soon as its program has finished (:attr:`Running.done`)
                rather than wait for its interpreter's teardown (a final collection over torch's
                objects: about a second, more under load). Only where the tasks' exit codes
                decide nothing (an interrupt); never for a preemption, whose exit 42 asks for a
                restart.
        """
        runs = [r for r in (runs if runs is not None else self.alive()) if r.popen.poll() is None]
        if not runs:
            return
        grace = settings.stop_grace() if grace is None else grace
        self.signal_all(sig, runs)
        deadline = time.monotonic() + grace
        try:
            while True:
                left = [r for r in runs if r.popen.poll() is None]
                if not left or time.monotonic() >= deadline:
                    break
                finished = [r for r in left if r.done] if end_teardown else []
                if finished:
                    self.kill(finished)
                time.sleep(0.02)
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            pass
        self.kill([r for r in runs if r.popen.poll() is None])

    def stop_after_failure(self, grace: float | None = None) -> list[Exit]:
        """A task failed: SIGTERM to the others at once, SIGKILL to what is left after ``grace``
        seconds. A failing task (its error recorded, its traceback in its log) gets
        :data:`FAILING_GRACE_S` to end its own teardown. When every failure seen is only a
        consequence (a lost peer), the one it followed first gets up to :data:`CAUSE_WAIT_S` to
        show (:meth:`await_cause`). Returns the exits seen meanwhile."""
        grace = settings.stop_grace() if grace is None else grace
        seen = self.await_cause()
        seen += self.await_diagnosis()
        failing = self.failing()
        others = [r for r in self.alive() if r not in failing]
        self.signal_all(signal.SIGTERM, others)
        try:
            self.wait_any(self.alive(), min(grace, FAILING_GRACE_S))
            self.kill(failing)
            self.wait_any(self.alive(), max(0.0, grace - FAILING_GRACE_S))
        finally:
            self.kill()
        return seen + self.poll()

    def end_failing(self) -> list[Exit]:
        """Tasks that recorded an error and are still exiting get :data:`FAILING_GRACE_S` to end,
        then are killed (they count as failed by themselves). Returns the exits seen meanwhile."""
        failing = self.failing()
        if failing:
            self.wait_any(failing, FAILING_GRACE_S)
            self.kill(failing)
        return self.poll()

    def kill(self, runs: Sequence[Running] | None = None) -> None:
        for run in runs if runs is not None else self.alive():
            _note_stopped(run)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                run.popen.kill()
        for run in runs if runs is not None else self.runs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.popen.wait(timeout=5)

    def dump_stacks(self, runs: Sequence[Running], settle: float = 1.0) -> dict[str, str]:
        """Asks each task for its Python stack; returns what each wrote (or why there is none).

        A replica registers :mod:`faulthandler` on the stack-dump signal (``PHALANX_STACK_SIGNAL``,
        default SIGUSR2; :mod:`phalanx.launch.replica_hooks`), which writes every thread's stack to
        its log; py-spy is used where it is installed and the task has no such handler. A task
        without either is not signalled (the signal's default action would kill it).
        """
        sizes, stacks = {}, {}
        signalled = []
        sig = settings.stack_signal()
        for run in runs:
            path = run.task.log_path
            sizes[run.task.name] = os.path.getsize(path) if path and os.path.exists(path) else 0
            if _catches(run.pid, sig):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.pid, sig)
                signalled.append(run)
            elif shutil.which("py-spy"):
                try:
                    stacks[run.task.name] = subprocess.run(
                        ["py-spy", "dump", "--pid", str(run.pid)],
                        check=False,
                        capture_output=True,
                        text=True,
                        timeout=10,
                    ).stdout
                except (OSError, subprocess.SubprocessError) as e:
                    stacks[run.task.name] = f"(py-spy failed: {e})"
            else:
                stacks[run.task.name] = (
                    f"(no stack: it has no {sig.name} stack-dump handler (PHALANX_STACK_SIGNAL) "
                    "and py-spy is not installed)"
                )
        if signalled:
            time.sleep(settle)
        for run in signalled:
            path = run.task.log_path
            if path is None:
                stacks[run.task.name] = "(its stack is above)"
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(sizes[run.task.name])
                    stacks[run.task.name] = f.read().decode(errors="replace").strip() or "(no stack written)"
            except OSError:
                stacks[run.task.name] = "(no log)"
        return stacks

    # ------------------------------------------------------------------ reporting
    def diagnosis(self) -> dict | None:
        """The diagnosis a replica of this attempt wrote to the run directory, if any."""
        if not self.run_dir:
            return None
        return diagnosis.read(self.run_dir, since=self._attempt_started - 1.0)

    def report_root_cause(self, exits: Iterable[Exit] | None = None) -> Exit | None:
        """Prints the root-cause report once, in the one format; returns the failure it named.

        Where a replica wrote a diagnosis (its collective failed: it asked every replica where it
        was), the diagnosis names the cause when the failures seen only follow it (a timeout, a lost
        peer, collectives that do not match): the replica that never arrived, or that made another
        call, whatever its state, never the one that waited. The diagnosis is printed after the
        root cause, once.
        """
        exits = self.exits if exits is None else list(exits)
        cause = root_cause(exits)
        found = self.diagnosis() if cause is not None else None
        if cause is not None and found is not None:
            cause = diagnosed_cause(cause, exits, found, self.runs)
        if cause is not None:
            self._cause_reported = True
            self.say("root cause (first failure): " + format_failure(cause))
            if found is not None:
                self.say(diagnosis.render(found, where=os.path.join(self.run_dir or "", diagnosis.FILE)))
        return cause

    def note_cause_reported(self) -> None:
        """Someone else (the end-of-job policy, :mod:`phalanx.launch.job_end`) reported this attempt's root cause."""
        self._cause_reported = True

    def job_status(self, code: int) -> int:
        """The job's exit status for ``code``: never 0 once this attempt reported a root cause.

        Whatever path a job's end took, one that printed its root cause failed; a launcher passes
        its status through here last.
        """
        return 1 if code == 0 and self._cause_reported else code


def _note_recorded_error(run: Running) -> bool:
    """Whether ``run`` has recorded an uncaught exception (its error file exists); notes when first seen."""
    if run.failed_at is None and run.task.error_path and os.path.exists(run.task.error_path):
        run.failed_at = time.monotonic()
    return run.failed_at is not None


def _note_stopped(run: Running) -> None:
    """Notes, before the supervisor first signals ``run``, whether that stops it or it had failed by itself.

    One that had recorded its own error by then stays a failure, not a consequence of being
    stopped (its error file is looked for now, not at the last poll); an error it records after
    the signal (a KeyboardInterrupt, say) is the signal's.
    """
    if not run.stopped_by_supervisor:
        run.stopped_by_supervisor = not _note_recorded_error(run)
        if run.stopped_by_supervisor:
            run.state_when_stopped = _process_state(run.pid)


_STATES = {
    "T": "stopped (SIGSTOP or a debugger)",
    "t": "stopped by a debugger",
    "D": "in an uninterruptible wait (I/O)",
}


def _process_state(pid: int) -> str:
    """What ``pid`` was doing, from ``/proc/<pid>/stat`` ('' when unknown): says why a task stalled."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return _STATES.get(state, "running" if state in ("R", "S") else "")


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt in /proc/<pid>/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
