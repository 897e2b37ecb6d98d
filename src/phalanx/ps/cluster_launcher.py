"""``phalanx run --ps M --workers N train.py``: a parameter-server cluster on this host.

A configuration of :mod:`phalanx.launch.supervisor`. Starts one ``chief``, N ``worker`` and M
``ps`` processes of the same command. Each gets a ``TF_CONFIG`` naming the whole cluster on
127.0.0.1 (free ports) and its own task, and every process gets the same
``PHALANX_CLUSTER_SECRET`` (a fresh random one unless it is set already). The chief writes to
the terminal untouched; the others to ``LOGDIR/<run-id>/<task>_<index>.log`` (``--tee``: here too,
prefixed).

Supervision follows TF's fault model: a worker that exits is restarted on the same address up to
``max_restarts`` times (the coordinator reconnects and gives it new work); a parameter server is
not restarted (its variables are gone: the coordinator reports it and the job restarts from a
checkpoint). The job ends with the chief: the servers exit when its coordinator shuts the
cluster down. After a chief that finished normally, a task still running its program
``shutdown_grace`` seconds later fails the job, as a replica still running after replica 0
finished fails a synchronous one: it is named with its stack as the root cause, the rest are
stopped, and the status is 1. After a failed chief the root cause (the first failure across
tasks; when the chief only lost a task, that task's failure, awaited briefly) is printed once, and
the rest are stopped after ``shutdown_grace`` seconds.

:class:`ClusterLauncher` is this route's :class:`~phalanx.launch.launcher.Launcher` over the one
:class:`~phalanx.launch.supervisor.Supervisor`: its :attr:`~ClusterLauncher.state` is a
:class:`~phalanx.launch.lifecycle.JobState` (``RUNNING`` once every task was started, ``STOPPING``
once the chief ended, then ``SUCCEEDED`` or ``FAILED``) and :meth:`~ClusterLauncher.run` returns a
:class:`~phalanx.launch.lifecycle.RunResult` (every task's end, the root cause), as
``ScriptLauncher.run()`` does for ``phalanx run -n N``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from phalanx.launch.env import free_port
from phalanx.launch.job_end import Interrupted, forwarded_signals, stop_on_signal, wait_for_the_rest
from phalanx.launch.lifecycle import JobState, Lifecycle, RunResult
from phalanx.launch.root_cause import Task, describe_exit_code, exit_status, root_cause
from phalanx.launch.run_dir import RunDirectory
from phalanx.launch.supervisor import Supervisor
from phalanx.ps.secret import SECRET_ENV, generate_secret


@dataclass(frozen=True)
class ClusterJob:
    """What ``phalanx run --ps`` starts."""

    command: tuple[str, ...]
    num_ps: int
    num_workers: int
    max_restarts: int = 0
    log_dir: str = ""
    host: str = "127.0.0.1"
    shutdown_grace: float = 10.0
    tee: bool = False
    tls: bool = False
    start_method: str = "spawn"  # or "fork" (phalanx.launch.forkserver)
    preload: tuple[str, ...] = ()  # with fork: modules to import once besides the script's


def _threads(task_type: str, num_workers: int) -> str:
    # Workers share this host's cores; servers and the chief mostly wait on the network.
    cores = os.cpu_count() or 1
    return "1" if task_type == "ps" else str(max(1, cores // num_workers))


class _Cluster:
    def __init__(self, job: ClusterJob, sup: Supervisor) -> None:
        self.job = job
        self.sup = sup
        self.run = RunDirectory(job.log_dir or None, program=job.command).create()
        self.log_dir = self.run.path
        kinds = [("chief", 1), ("worker", job.num_workers), ("ps", job.num_ps)]
        ports = {(kind, i): free_port(job.host) for kind, n in kinds for i in range(n)}
        cluster = {kind: [f"{job.host}:{ports[(kind, i)]}" for i in range(n)] for kind, n in kinds}
        secret = os.environ.get(SECRET_ENV) or generate_secret()
        tls_env: dict[str, str] = {}
        if job.tls:  # a throwaway CA and certificate for this run (<run dir>/tls), as PHALANX_TLS_*
            from phalanx.ps.tls import generate_local

            tls_env = generate_local(os.path.join(self.log_dir, "tls"), hosts=(job.host, "localhost"))
        self.tasks: dict[str, Task] = {}
        for kind, n in kinds:
            for index in range(n):
                name = f"{kind}:{index}"
                env = {
                    "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}),
                    SECRET_ENV: secret,
                    "PHALANX_RESTART_COUNT": "0",
                    **tls_env,
                }
                if "OMP_NUM_THREADS" not in os.environ:
                    env["OMP_NUM_THREADS"] = _threads(kind, job.num_workers)
                to_terminal = kind == "chief" and not job.tee
                self.tasks[name] = Task(
                    name=name,
                    command=(sys.executable, *job.command),
                    env=env,
                    log_path=None if to_terminal else self.run.log_path(f"{kind}_{index}"),
                    error_path=self.run.error_path(f"{kind}_{index}"),
                    done_path=self.run.done_path(f"{kind}_{index}"),
                )
        self.restarts = {name: 0 for name in self.tasks}

    def log_path(self, name: str) -> str | None:
        return self.tasks[name].log_path

    def start_all(self) -> None:
        for task in self.tasks.values():
            self.sup.start(task)

    def supervise(self) -> int:
        """Runs until the chief ends; returns its exit code."""
        while True:
            for ended in self.sup.poll():
                name = ended.task.name
                if name == "chief:0":
                    return ended.code
                if not ended.failed:
                    continue  # told to stop by the coordinator: the chief is ending too
                if name.startswith("worker:") and self.restarts[name] < self.job.max_restarts:
                    self.restarts[name] += 1
                    self.sup.say(
                        f"{name} failed with {describe_exit_code(ended.code)}; restarting it "
                        f"({self.restarts[name]} of {self.job.max_restarts})"
                    )
                    env = {**ended.task.env, "PHALANX_RESTART_COUNT": str(self.restarts[name])}
                    self.tasks[name] = dataclasses.replace(ended.task, env=env)
                    self.sup.start(self.tasks[name])
                else:
                    self.sup.say(
                        f"{name} (pid {ended.pid}) failed with {describe_exit_code(ended.code)}"
                        + (f"; its log: {ended.task.log_path}" if ended.task.log_path else "")
                    )
            time.sleep(0.05)

    def stop(self, grace: float) -> None:
        """Waits ``grace`` seconds for the tasks to end on their own, then stops the rest."""
        self.sup.wait_any(self.sup.alive(), grace)
        alive = self.sup.alive()
        if alive:
            self.sup.say(f"stopping {len(alive)} task(s) still running after the chief ended")
        self.sup.stop(signal.SIGTERM, grace=2.0)
        self.sup.poll()


def run_cluster(job: ClusterJob) -> int:
    """Runs the cluster until the chief ends; returns the job's exit status."""
    return ClusterLauncher(job).run().status


class ClusterLauncher:
    """``phalanx run --ps``'s launcher: starts the cluster's tasks on this host and supervises them.

    The cluster's tasks find their identity in ``TF_CONFIG``, so no strategy holds this launcher:
    :meth:`check_peers`, :meth:`strategy_opened` and :meth:`strategy_closed` have nothing to do.
    """

    def __init__(self, job: ClusterJob) -> None:
        if job.num_ps < 1 or job.num_workers < 1:
            raise ValueError(
                f"a parameter-server cluster needs --ps >= 1 and --workers >= 1; received "
                f"ps={job.num_ps}, workers={job.num_workers}"
            )
        self.job = job
        self.lifecycle = Lifecycle()
        self.supervisor = Supervisor(tee=job.tee, start_method=job.start_method, preload=job.preload)

    @property
    def state(self) -> JobState:
        """Where the cluster's tasks are (:mod:`phalanx.launch.lifecycle`)."""
        return self.lifecycle.state

    def check_peers(self) -> None:
        """Nothing to raise: the tasks are this launcher's, not a strategy's local replicas."""

    def strategy_opened(self, strategy: Any) -> None:
        """No strategy runs on this launcher's tasks from here (each task makes its own)."""

    def strategy_closed(self, strategy: Any) -> None:
        """See :meth:`strategy_opened`."""

    def run(self) -> RunResult:
        """Runs the cluster until the chief ends (then the rest); how it ended."""
        status = self._run()
        self.lifecycle.end(status)
        exits = tuple(self.supervisor.exits)
        return RunResult(self.state, status, exits, root_cause(exits) if status != 0 else None)

    def _run(self) -> int:
        job, sup = self.job, self.supervisor
        cluster = _Cluster(job, sup)
        here = "every task writes here, prefixed; " if job.tee else "the chief writes here; "
        sup.say(
            f"chief + {job.num_workers} worker(s) + {job.num_ps} parameter server(s) on {job.host}; "
            f"{here}logs in {cluster.log_dir}"
        )
        with forwarded_signals():
            try:
                cluster.start_all()
                self.lifecycle.to(JobState.RUNNING)
                code = cluster.supervise()
                self.lifecycle.to(JobState.STOPPING)
                if code == 0:  # the others must end too, and soon: one still running is a failure
                    return sup.job_status(wait_for_the_rest(sup, primary="chief:0", limit=job.shutdown_grace))
                # The chief often fails only because a task it needed is gone (ParameterServerUnavailableError):
                # that task's own failure is the root cause, and it may still be exiting (its error
                # recorded, its teardown under way) or its end not yet seen. Wait for it, briefly.
                sup.await_cause()
                sup.end_failing()
                sup.report_root_cause()
                cluster.stop(job.shutdown_grace)
                return sup.job_status(exit_status(code))
            except Interrupted as e:
                self.lifecycle.to(JobState.STOPPING)
                return stop_on_signal(sup, e.signum)
            except BaseException:
                self.lifecycle.to(JobState.FAILED)
                sup.kill()
                raise
            finally:
                sup.close()
