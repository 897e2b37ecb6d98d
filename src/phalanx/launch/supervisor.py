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

The concerns around the loop live beside it: how a task's process is made
(:mod:`phalanx.launch.starter`: spawned or forked, its environment and output), run directories
and logs (:mod:`phalanx.launch.run_dir`), the task records and the root cause
(:mod:`phalanx.launch.root_cause`), and how a launcher's job ends on a signal or after replica 0
(:mod:`phalanx.launch.job_end`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import IO

from phalanx.comm import diagnosis
from phalanx.launch import settings
from phalanx.launch.forkserver import ForkServer
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
from phalanx.launch.starter import ChildProcess, TaskStarter

__all__ = ["CAUSE_WAIT_S", "Supervisor"]

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
        self._out = out
        self._runs: list[Running] = []
        self._exits: list[Exit] = []
        self._cause_reported = False  # this attempt printed a root cause: it failed (job_status)
        # Where the tasks' run directory is (their logs, and a diagnosis a replica wrote there).
        self.run_dir = run_dir
        self._attempt_started = time.time()
        self._lock = threading.Lock()
        # How a task's process comes to exist (spawned, or forked from a server; its output).
        self._starter = TaskStarter(start_method, tuple(preload), tee, run_dir, self.say)

    @property
    def start_method(self) -> str:
        """``spawn`` or ``fork``; ``spawn`` from the moment a fork server could not start."""
        return self._starter.start_method

    @property
    def fork_server(self) -> ForkServer | None:
        """The server this supervisor forks its tasks from, once one was needed."""
        return self._starter.fork_server

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
        run = self._starter.start(task)
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

    def close(self) -> None:
        """Ends the fork server, if one was started (call once every task has ended)."""
        self._starter.close()

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
