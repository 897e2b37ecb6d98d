"""``python train.py`` with a multi-replica strategy: the script starts its other replicas itself.

A configuration of :mod:`phalanx.launch.supervisor`. The process the user started becomes
replica 0 and keeps its terminal; it runs the same command again for replicas 1..N-1 with their
identity in the environment (:class:`~phalanx.launch.env.ReplicaEnv`), their output in
``LOGDIR/<run-id>/replica_<k>.log``. The replicas are started once per program: a second
multi-replica strategy (TF's tutorials create several) runs on the same processes
(:func:`launch`).

Exit rules, the same as ``phalanx run``'s:

* a replica that fails ends the job: the others are stopped, the root cause is printed once, and
  replica 0 exits 1 (at its next collective, or a moment later);
* an uncaught exception on replica 0 stops the others at once. When it only says that a peer is
  gone (``PeerUnavailableError``), the peer's own failure is awaited briefly (its exit, its error
  file) and named as the root cause; replica 0 never exits before the root cause is printed,
  whichever process ended first;
* a Ctrl-C is the user's, not a failure: replica 0 says it was interrupted, passes SIGINT to the
  others (SIGKILL after ``PHALANX_STOP_GRACE`` seconds) and exits as Python does (status 130);
* when replica 0 finishes normally it waits for the others, saying so after a second; one still
  running after ``PHALANX_EXIT_TIMEOUT`` seconds is named with its stack, and replica 0 exits 1.

Python embedded in another program (R through reticulate, :mod:`phalanx.launch.host`): the
replicas are fresh host processes running the host's command line again (``Rscript script.R``).
Such a host runs no Python exit handlers, so the end is explicit: closing the program's last
multi-replica strategy (``strategy$close()``) waits for the replicas as the exit above does, and
raises :class:`~phalanx.errors.ReplicaFailedError` (the replica and its error) if one failed.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from phalanx._signal_routing import helper_threads_ignore_stop_signals
from phalanx.errors import LaunchError, ReplicaFailedError
from phalanx.launch import forkserver, host, settings
from phalanx.launch.env import ReplicaEnv
from phalanx.launch.job_end import wait_for_the_rest
from phalanx.launch.lifecycle import JobState, Lifecycle, RunResult
from phalanx.launch.root_cause import Task, format_failure, root_cause
from phalanx.launch.run_dir import RunDirectory
from phalanx.launch.stdio import fill_closed, flush_quietly
from phalanx.launch.supervisor import CAUSE_WAIT_S, Supervisor

_MAIN_GRACE_S = 0.3  # after another replica failed, replica 0 gets this long to fail by itself
_job: ReplicaLauncher | None = None
_job_lock = threading.Lock()
_ended_job: ReplicaLauncher | None = None  # the job an embedded host ended by closing its last strategy


def _report_bound() -> float:
    """How long replica 0 waits, before it exits, for the report of a failure that another thread
    handles: the wait for the cause, the stop (its grace, then SIGKILL and reaping), the grace above."""
    return CAUSE_WAIT_S + settings.stop_grace() + _MAIN_GRACE_S + 5.0


def _script_command() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if os.environ.get("PYTEST_CURRENT_TEST"):
        raise LaunchError(
            "A multi-replica strategy cannot start its replicas from inside pytest.",
            hint="run the training code as a script (python train.py) or with `phalanx run -n N train.py`",
        )
    if host.embedded():  # R through reticulate: the replicas run the host's program again, not Python
        return host.command()
    if spec is not None and spec.name and spec.name != "__main__":
        return [sys.executable, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    script = getattr(main, "__file__", None)
    if not script or not os.path.exists(script):
        raise LaunchError(
            "A multi-replica strategy needs a script to start its replicas from; this "
            "interpreter runs no script file (interactive or `python -c`).",
            hint="save the code to train.py and run `python train.py` or `phalanx run -n N train.py`",
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


def current_job() -> ReplicaLauncher | None:
    """The replicas this process started (it is their replica 0), if any."""
    return _job


def launch(world_size: int) -> ReplicaLauncher:
    """Starts replicas 1..world_size-1 of this script, or returns those started before.

    Raises:
        LaunchError: replicas were started already for another number of replicas.
    """
    global _job
    with _job_lock:
        if _job is None and _ended_job is not None:
            # Its replicas ran the host's program to its end: new ones would start it from the top.
            raise LaunchError(
                "This program's replicas have ended: closing its last multi-replica strategy ended "
                "them, and a new strategy cannot start them again midway through the program.",
                hint="close the strategies at the end of the program (create the next one before closing the last)",
            )
        if _job is None:
            _job = ReplicaLauncher(world_size)
        elif _job.world_size != world_size:
            raise LaunchError(
                f"This program already runs {_job.world_size} replica processes; a strategy over "
                f"{world_size} devices cannot run on them.",
                hint=f"give every multi-replica strategy of the program {_job.world_size} devices",
            )
        return _job


class ReplicaLauncher:
    """Starts and supervises replicas 1..N-1 of the current script; this process is replica 0."""

    # Its supervisor prints the diagnosis a replica writes to the run directory (replica 0 too).
    prints_diagnosis = True

    def __init__(self, world_size: int) -> None:
        # A program started with a closed stdout, stderr or stdin: /dev/null on that descriptor, or
        # the log files, pipes and fork-server socket opened below would take its number (and a
        # child started with this process's stdout would write into them). Its sys.stdout stays
        # None, as Python made it.
        fill_closed()
        self.lifecycle = Lifecycle()  # STARTING until every replica was started
        self.world_size = world_size
        self.command = _script_command()
        self.run = RunDirectory(program=self.command).create()
        self.run_id, self.log_dir = self.run.run_id, self.run.path
        self.env = ReplicaEnv.local_chief(world_size, self.run_id, self.log_dir)
        # The fork start pays one import of torch (and Keras) for all the replicas it starts: worth
        # it from two on; one replica pays the same itself, and starts sooner. A program that was
        # itself forked from a fork server (phalanx run's, a test suite's) forks from that one.
        # A host that is not Python (R) starts as itself: a Python fork server cannot run its program.
        self.embedded = host.embedded()
        forking = not self.embedded and (world_size > 2 or forkserver.has_inherited_server())
        self.supervisor = Supervisor(start_method=settings.start_method() if forking else "spawn", run_dir=self.log_dir)
        self._ended = threading.Event()  # the job's outcome is decided (failure handled, or finished)
        self._reported = threading.Event()  # ... and its failure reported (root cause, or interrupt)
        self._main_exiting = threading.Event()
        self._own_failure = False
        self._lock = threading.Lock()
        self._strategies: list[weakref.ref] = []  # the open strategies that run on these replicas
        self._finished = False  # the replicas were waited for (finish, or an embedded host's end)
        for rank in range(1, world_size):
            identity = ReplicaEnv(**{**self.env.__dict__, "rank": rank, "local_rank": rank})
            self.supervisor.start(
                Task(
                    name=f"replica {rank}",
                    command=tuple(self.command),
                    env=identity.to_environ(),
                    log_path=self.run.log_path(f"replica_{rank}"),
                    error_path=self.run.error_path(f"replica_{rank}"),
                    done_path=self.run.done_path(f"replica_{rank}"),
                    info=f"local rank {rank}",
                )
            )
        self.supervisor.say(f"started replicas 1..{world_size - 1}; their logs are in {self.log_dir}")
        self.lifecycle.to(JobState.RUNNING)
        self._install_excepthook()
        atexit.register(self.finish)
        self._watcher = threading.Thread(target=self._watch, name="phalanx-replica-watcher", daemon=True)
        with helper_threads_ignore_stop_signals():  # a Ctrl-C must wake the main thread, not this one
            self._watcher.start()

    def log_path(self, rank: int) -> str:
        return self.run.log_path(f"replica_{rank}")

    @property
    def state(self) -> JobState:
        """Where the replicas are (:mod:`phalanx.launch.lifecycle`)."""
        return self.lifecycle.state

    def result(self) -> RunResult:
        """How the run stands, or ended: the state, every replica's end and the root cause."""
        exits = tuple(self.supervisor.exits)
        failed = self.state is JobState.FAILED
        cause = root_cause(exits) if failed else None
        return RunResult(self.state, (cause.status or 1) if cause is not None else int(failed), exits, cause)

    # ------------------------------------------------------------------ strategies
    def check_peers(self) -> None:
        """Nothing to raise: this launcher's watcher thread ends the program when a replica dies."""

    def strategy_opened(self, strategy: Any) -> None:
        """A strategy of this program runs on these replicas (its ``close`` may end the job)."""
        self._strategies.append(weakref.ref(strategy))

    def strategy_closed(self, strategy: Any) -> None:
        """Called by ``strategy.close()``. In an embedded host, the last one closed ends the job.

        Raises:
            ReplicaFailedError: (embedded host) a replica failed.
        """
        self._strategies = [r for r in self._strategies if r() is not None and r() is not strategy]
        if self.embedded and not self._strategies:
            self.end()

    def end(self) -> None:
        """Waits (bounded, saying so) for the replicas to finish the program; for hosts without ``atexit``.

        The exit rules of the module docstring, except that a failure is raised to the host
        program (R halts with it, running its own clean-up) instead of ending this process.

        Raises:
            ReplicaFailedError: a replica failed (or was still running after ``PHALANX_EXIT_TIMEOUT``).
        """
        global _job, _ended_job
        if self._finished:
            return
        self._main_exiting.set()
        with self._lock:
            failed_before = self._ended.is_set()
            self._ended.set()
        if failed_before:  # the watcher is stopping the others and naming the cause: let it finish
            self._reported.wait(_report_bound())
            code = 1
        else:
            self.lifecycle.to(JobState.STOPPING)
            code = self.supervisor.job_status(wait_for_the_rest(self.supervisor))
        self.supervisor.close()
        self.lifecycle.end(code)
        self._finished = True
        with _job_lock:
            if _job is self:
                _job, _ended_job = None, self
        if code != 0:
            cause = root_cause(self.supervisor.exits)
            if cause is None:
                raise ReplicaFailedError("a replica", f"a replica of this program failed; see {self.log_dir}")
            raise ReplicaFailedError(cause.task.name, format_failure(cause))

    # ------------------------------------------------------------------ failures
    def _install_excepthook(self) -> None:
        previous = sys.excepthook

        def hook(kind, value, tb):
            try:
                previous(kind, value, tb)  # the traceback first: a report follows it
            finally:
                if issubclass(kind, KeyboardInterrupt):
                    self._interrupted()
                else:
                    self._abort(f"{kind.__name__}: {value}")

        sys.excepthook = hook

    def _claim(self) -> bool:
        """Whether this thread decides the job's outcome (no other did before)."""
        with self._lock:
            if self._ended.is_set():
                return False
            self._ended.set()
            self.lifecycle.to(JobState.STOPPING)
            return True

    def _abort(self, message: str) -> None:
        """Replica 0 ends with an error: stop the others now and name the first failure."""
        task = Task(name="replica 0", command=tuple(self.command), log_path=None, info="local rank 0")
        self.supervisor.record(task, os.getpid(), 1, message)  # before the watcher can report

        def stop_and_report() -> None:
            # When replica 0's error only says that a peer is gone, this waits (briefly) for that
            # peer's own failure, which is then the root cause.
            self.supervisor.stop_after_failure()
            self.supervisor.report_root_cause()

        self._end_on_main_thread(stop_and_report)

    def _interrupted(self) -> None:
        """A Ctrl-C (KeyboardInterrupt) on replica 0: the user's, not a failure. The others get it too."""

        def stop_the_others() -> None:
            others = self.supervisor.alive()
            if not others:
                self.supervisor.say("interrupted (SIGINT)")
                return
            n = len(others)
            self.supervisor.say(f"interrupted (SIGINT); stopping {n} other replica{'s' if n > 1 else ''}")
            # Passed on as it came, so that the others end as an interrupted program does (their
            # finally blocks run); a replica only tearing down after that is not waited for.
            self.supervisor.stop(signal.SIGINT, end_teardown=True)
            self.supervisor.poll()

        self._end_on_main_thread(stop_the_others)

    def _end_on_main_thread(self, end: Callable[[], None]) -> None:
        """Replica 0's own end (an error, a Ctrl-C): ``end`` decides the job's outcome and reports it,
        unless the watcher already handles another replica's failure (often the one replica 0's error
        only follows); then this process waits for that report, bounded, since it must not exit first."""
        self._main_exiting.set()
        if not self._claim():
            self._reported.wait(_report_bound())
            return
        self._own_failure = True  # Python's own exit status (1, or 130 for Ctrl-C) stands
        try:
            end()
        finally:
            self.lifecycle.to(JobState.FAILED)
            self._reported.set()

    def _watch(self) -> None:
        while not self._ended.wait(0.05):
            ended = self.supervisor.poll()
            if not any(e.failed for e in ended) and not self.supervisor.failing():
                continue
            if not self._claim():
                return
            try:
                self.supervisor.stop_after_failure()
                # Replica 0 may fail on its own at its next collective: its traceback first (its
                # excepthook prints it, then records its error), the root cause last.
                main_exiting = self._main_exiting.wait(_MAIN_GRACE_S)
                self.supervisor.report_root_cause()
            finally:
                self.lifecycle.to(JobState.FAILED)
                self._reported.set()
            # If replica 0 is busy elsewhere or blocked where it cannot notice, end it now: the
            # job never outlives its error.
            if not main_exiting:
                self.supervisor.say("replica 0 stops because another replica failed")
                _exit(1)
            return

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """At exit: waits (bounded, and saying so) for the replicas; any failure makes this process fail."""
        if self._finished:  # ended by end(), which raised any failure to the program
            return
        self._main_exiting.set()
        with self._lock:
            failed_before = self._ended.is_set()
            self._ended.set()
        if failed_before:
            # The watcher may still be stopping the others and naming the cause: its report comes
            # out before this process ends (bounded: it never waits more than the report takes).
            self._reported.wait(_report_bound())
            if self._own_failure:
                # The job has failed and every replica is stopped: leave the objects of this process
                # to the OS rather than to a final collection over torch's and Keras' (which took
                # seconds on a loaded machine), so the job ends when its error is out.
                gc.freeze()
                return
            _exit(1)  # another replica failed: never exit 0, whatever replica 0 did after
        self.lifecycle.to(JobState.STOPPING)
        code = self.supervisor.job_status(wait_for_the_rest(self.supervisor))
        self.supervisor.close()
        self.lifecycle.end(code)
        if code != 0:
            _exit(1)


def _exit(code: int) -> None:
    flush_quietly()  # a closed or broken stream must not keep the process alive
    os._exit(code)
