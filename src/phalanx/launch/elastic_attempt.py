"""``phalanx run --min-nproc M``: a job that goes on when it loses replicas (the launcher's side).

The replicas re-form their group themselves (:mod:`phalanx.comm.elastic`); the launcher's part is
to serve the store they meet in from a process of its own (:mod:`phalanx.launch.store_host`), so
that losing any replica, replica 0 included, leaves it, and to tell a lost replica from a failed
program:

* a replica killed by a signal it did not get from the launcher (``kill -9``, the OOM killer, a
  crash) is **lost**: the job goes on while at least ``M`` replicas remain, and says so;
* a replica that records an uncaught exception, or exits with a non-zero status of its own
  (``sys.exit(3)``), has **failed**, as in any job: the others are stopped and the root cause
  printed (an error in the program would only repeat on the others);
* fewer than ``M`` replicas left: the survivors end with
  :class:`~phalanx.errors.ElasticRecoveryError`, and the job fails naming the lost ones first.

The job succeeds when every replica that was not lost has finished normally.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Sequence

from phalanx.launch import settings
from phalanx.launch.root_cause import Exit, Task
from phalanx.launch.run_dir import RunDirectory
from phalanx.launch.supervisor import Supervisor

#: Set for the replicas of a job whose store the launcher serves at ``MASTER_ADDR:MASTER_PORT``.
LAUNCHER_STORE = "PHALANX_LAUNCHER_STORE"


def store_task(run: RunDirectory, host: str, port: int) -> Task:
    """The task that serves the job's store at ``host:port``."""
    return Task(
        name="store",
        command=(sys.executable, "-m", "phalanx.launch.store_host", host, str(port)),
        log_path=run.log_path("store"),
        error_path=run.error_path("store"),
        info=f"the job's store at {host}:{port}",
    )


def lost(ended: Exit) -> bool:
    """Whether a replica's end is a loss the job can go on without: killed by a signal, not by
    this launcher, without an error recorded."""
    return ended.code < 0 and not ended.message and not ended.stopped_by_supervisor


def describe(ended: Exit) -> str:
    """How a lost replica ended (``killed by SIGKILL``)."""
    try:
        return f"killed by {signal.Signals(-ended.code).name}"
    except ValueError:
        return f"killed by signal {-ended.code}"


def supervise(
    sup: Supervisor,
    store: Task,
    replicas: Sequence[Task],
    min_nproc: int,
    fail: Callable[[Supervisor, list[Exit], Exit | None], int],
    *,
    max_nproc: int = 0,
    replacement: Callable[[Task, int], Task] | None = None,
) -> int:
    """Watches an elastic attempt until every replica not lost has finished; returns its status.

    ``fail(sup, exits, first)`` stops the job after a failure and returns its status (the
    launcher's usual root-cause report). Once a replica has finished normally, the others get
    ``PHALANX_EXIT_TIMEOUT`` seconds to finish too, as in any job. After a loss, while fewer than
    ``max_nproc`` replicas run, ``replacement(lost task, new member id)`` is started: it joins the
    group at a step boundary (:mod:`phalanx.core.rejoin`), or exits 0 if the job ends first.
    """
    sup.start(store)
    for task in replicas:
        sup.start(task)
    running = {t.name for t in replicas}
    exits: list[Exit] = []
    finished_at: float | None = None
    next_member = len(replicas)  # a replacement's id: never one a lost replica had
    replacements: set[str] = set()
    try:
        while True:
            for ended in sup.poll():
                exits.append(ended)
                if ended.task is store:
                    return fail(sup, exits, ended)  # without its store the job cannot go on
                running.discard(ended.task.name)
                if not ended.failed:
                    finished_at = finished_at or time.monotonic()
                    continue
                if ended.task.name in replacements and ended.message:
                    # A replacement the group refused (another model, no input position to start
                    # from): the group goes on without it.
                    why = ended.message.strip().splitlines()[0][:400]
                    sup.say(f"{ended.task.name} could not join: {why}")
                    continue
                if lost(ended) and len(running) >= min_nproc:
                    sup.say(
                        f"{ended.task.name} was lost ({describe(ended)}); the job goes on with "
                        f"{len(running)} replica(s) (--min-nproc {min_nproc})"
                    )
                    if replacement is not None and len(running) < max_nproc:
                        task = replacement(ended.task, next_member)
                        next_member += 1
                        sup.start(task)
                        running.add(task.name)
                        replacements.add(task.name)
                        sup.say(f"{task.name} started to replace it; it joins at a step boundary")
                    continue
                return fail(sup, exits, ended)
            if any(r.task.name not in replacements for r in sup.failing()):  # a refused replacement ends by itself
                return fail(sup, exits, None)
            if not running:
                sup.stop(runs=[r for r in sup.alive() if r.task is store], grace=2.0)
                sup.poll()
                return 0
            if finished_at is not None and time.monotonic() - finished_at > settings.exit_timeout():
                sup.say(
                    f"{', '.join(sorted(running))} still running {settings.exit_timeout():g} s after another "
                    "replica finished; stopped"
                )
                sup.kill()
                sup.poll()
                return 1
            time.sleep(0.05)
    except BaseException:
        sup.kill()
        raise
