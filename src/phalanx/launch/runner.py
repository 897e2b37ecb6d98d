"""``phalanx run``: start the replica processes of a job on this host and supervise them.

A configuration of :mod:`phalanx.launch.supervisor`: replica 0 (of node 0) writes to this
terminal untouched, exactly as ``python train.py`` would; the others write to
``LOGDIR/<run-id>/replica_<k>.log`` (``--tee`` shows them here too, prefixed). phalanx adds the
replica identity (:class:`~phalanx.launch.env.ReplicaEnv`), whole-group restarts, and the exit
rules every launcher shares:

* a replica that fails, or an interrupt, ends the whole job at once, with the root cause printed
  once and a non-zero exit code;
* a replica still running ``PHALANX_EXIT_TIMEOUT`` seconds after replica 0 finished normally is a
  failure: it is named, its stack is shown, and the job exits 1 (the launcher says that it waits);
* SIGTERM to the launcher (preemption) reaches every replica, which get
  ``PHALANX_PREEMPTION_GRACE`` seconds to save; a job whose replicas exit with 42 after saving is
  restarted without using up ``--max-restarts``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass

from phalanx.launch import elastic_attempt, settings
from phalanx.launch.elastic_attempt import LAUNCHER_STORE
from phalanx.launch.env import ReplicaEnv, free_port
from phalanx.launch.job_end import Interrupted, forwarded_signals, stop_on_signal, wait_for_the_rest
from phalanx.launch.lifecycle import JobState, Lifecycle, RunResult
from phalanx.launch.root_cause import Exit, Task, root_cause
from phalanx.launch.run_dir import RunDirectory
from phalanx.launch.supervisor import Supervisor

RESTART_EXIT_CODE = 42  # a replica asking to be restarted (preemption), as TF's handler does
MAX_PREEMPTION_RESTARTS = 100


@dataclass(frozen=True)
class JobSpec:
    """What ``phalanx run`` starts on this host.

    Attributes:
        command: the program and its arguments (``["train.py", "--epochs", "3"]``, or ``["-m", "pkg"]``).
        nproc: replica processes on this host.
        nnodes, node_rank, master_addr, master_port: the multi-host layout (1 node by default).
        max_restarts: how many times the whole group is restarted after a failure.
        log_dir: the log root (run directories go inside); default ``PHALANX_LOG_ROOT`` or a temp dir.
        tee: show every replica's output on this terminal, each line prefixed with its name.
        start_method: ``fork`` or ``spawn`` (:mod:`phalanx.launch.forkserver`); default
            :func:`phalanx.launch.settings.start_method`.
        preload: with ``fork``, modules to import once besides those found in the script (a
            module the script imports through one of its own, say).
        min_nproc: an elastic job (0: not one): it goes on while at least this many replicas
            remain (:mod:`phalanx.launch.elastic_attempt`).
        max_nproc: in an elastic job, a lost replica is replaced while fewer than this many run
            (default: ``nproc``; the replacement joins at a step boundary).
    """

    command: tuple[str, ...]
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    max_restarts: int = 0
    log_dir: str = ""
    tee: bool = False
    start_method: str = ""
    preload: tuple[str, ...] = ()
    min_nproc: int = 0
    max_nproc: int = 0


def run_job(spec: JobSpec) -> int:
    """Runs the job, restarting the whole group up to ``spec.max_restarts`` times; returns the exit code."""
    return ScriptLauncher(spec).run().status


class ScriptLauncher:
    """``phalanx run``'s launcher: starts the job's replicas on this host and supervises them.

    Its :attr:`state` goes through the :class:`~phalanx.launch.lifecycle.JobState` of every
    launcher (``RUNNING`` again at each restart of the whole group); :meth:`run` returns the
    :class:`~phalanx.launch.lifecycle.RunResult`.
    """

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.lifecycle = Lifecycle()
        self.supervisor: Supervisor | None = None

    @property
    def state(self) -> JobState:
        return self.lifecycle.state

    def run(self) -> RunResult:
        """Runs the job to its end (the attempts, the restarts, an interrupt); how it ended."""
        status = self._run()
        self.lifecycle.end(status)
        sup = self.supervisor
        exits = tuple(sup.exits) if sup is not None else ()
        return RunResult(self.state, status, exits, root_cause(exits) if status != 0 else None)

    def _run(self) -> int:
        spec = self.spec
        start_method = spec.start_method or settings.start_method()
        run = RunDirectory(spec.log_dir or None, program=spec.command).create()
        sup = self.supervisor = Supervisor(
            tee=spec.tee, start_method=start_method, preload=spec.preload, run_dir=run.path
        )
        here = (
            "every replica writes here, prefixed; "
            if spec.tee
            else ("replica 0 writes here; " if spec.node_rank == 0 else "")
        )
        sup.say(f"{spec.nproc} replica(s) on this host; {here}logs in {run.path}")
        with forwarded_signals():
            try:
                attempt = failures = preemptions = 0
                while True:
                    self.lifecycle.to(JobState.RUNNING)
                    code = sup.job_status(_run_attempt(spec, sup, run, attempt))
                    if code == 0:
                        return 0
                    attempt += 1
                    # A preempted job (every replica saved and asked for a restart) did not fail: it does
                    # not use up --max-restarts, though a bound keeps a job that always asks from looping.
                    if code == RESTART_EXIT_CODE and preemptions < MAX_PREEMPTION_RESTARTS:
                        preemptions += 1
                        sup.say("the job saved and asked to be restarted (preemption); restarting")
                        continue
                    if failures >= spec.max_restarts:
                        return code
                    failures += 1
                    sup.say(f"restarting the job (restart {failures} of {spec.max_restarts})")
            except Interrupted as e:
                self.lifecycle.to(JobState.STOPPING)
                return stop_on_signal(sup, e.signum)
            finally:
                sup.close()


def _tasks(spec: JobSpec, run: RunDirectory, attempt: int, port: int) -> list[Task]:
    world = spec.nproc * spec.nnodes
    elastic = {"PHALANX_MIN_NPROC": str(spec.min_nproc), LAUNCHER_STORE: "1"} if spec.min_nproc else {}
    tasks = []
    for local in range(spec.nproc):
        rank = spec.node_rank * spec.nproc + local
        env = ReplicaEnv(
            rank=rank,
            world_size=world,
            local_rank=local,
            local_world_size=spec.nproc,
            master_addr=spec.master_addr,
            master_port=port,
            node_rank=spec.node_rank,
            num_nodes=spec.nnodes,
            run_id=run.run_id,
            log_dir=run.path,
        )
        to_terminal = rank == 0 and not spec.tee  # replica 0 writes to the terminal, untouched
        tasks.append(
            Task(
                name=f"replica {rank}",
                command=(sys.executable, *spec.command),
                env={**env.to_environ(), "PHALANX_RESTART_COUNT": str(attempt), **elastic},
                log_path=None if to_terminal else run.log_path(f"replica_{rank}"),
                error_path=run.error_path(f"replica_{rank}"),
                done_path=run.done_path(f"replica_{rank}"),
                info=f"node {spec.node_rank}, local rank {local}",
            )
        )
    return tasks


def _run_attempt(spec: JobSpec, sup: Supervisor, run: RunDirectory, attempt: int) -> int:
    sup.forget_exits()
    port = spec.master_port or free_port(spec.master_addr)
    tasks = _tasks(spec, run, attempt, port)
    if spec.min_nproc:

        def replacement(lost: Task, member: int) -> Task:
            return dataclasses.replace(
                lost,
                name=f"replica {member}",
                env={**lost.env, "PHALANX_JOIN_AS": str(member)},
                log_path=run.log_path(f"replica_{member}"),
                error_path=run.error_path(f"replica_{member}"),
                done_path=run.done_path(f"replica_{member}"),
                info=f"{lost.info}, replacing {lost.name}",
            )

        store = elastic_attempt.store_task(run, spec.master_addr, port)
        return elastic_attempt.supervise(
            sup,
            store,
            tasks,
            spec.min_nproc,
            _fail,
            max_nproc=spec.max_nproc or spec.nproc,
            replacement=replacement,
        )
    started = [sup.start(task) for task in tasks]
    primary = started[0] if spec.node_rank == 0 else None  # replica 0 lives on node 0
    exits: list[Exit] = []
    try:
        while True:
            for ended in sup.poll():
                exits.append(ended)
                if ended.failed:
                    return _fail(sup, exits, ended)
                if primary is not None and ended.task is primary.task:
                    return wait_for_the_rest(sup)  # the others must finish too, and soon
            if sup.failing():  # a replica recorded an uncaught exception and is tearing down
                return _fail(sup, exits, None)
            if not sup.alive():
                return 0
            time.sleep(0.05)
    except Interrupted:
        raise  # the caller forwards the signal and gives the replicas their grace period
    except BaseException:
        sup.kill()  # nothing of this attempt outlives a launcher error
        raise


def _fail(sup: Supervisor, exits: list[Exit], first: Exit | None) -> int:
    """A replica failed: stop the rest and print the root cause once; returns the exit status."""
    if first is not None and first.code == RESTART_EXIT_CODE:
        # A preempted replica saved and asked for a restart; its peers are finishing their own
        # saves: let them end by themselves before stopping anything.
        sup.wait_any(sup.alive(), settings.preemption_grace())
    exits.extend(sup.stop_after_failure())
    cause = sup.report_root_cause(exits)
    assert cause is not None
    return cause.status or 1
