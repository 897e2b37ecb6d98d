"""The one place that chooses how a synchronous strategy's replica processes come to exist.

It sits above the launchers it chooses among (Lightning's strategy configures its own launcher the
same way): the launcher's environment and self-launch (:mod:`phalanx.launch`), and a notebook
session (:mod:`phalanx.interactive.session`). :mod:`phalanx.launch.api` says what each route is and
what a strategy holds afterwards (a :class:`~phalanx.launch.api.Launcher`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.interactive import hooks, interactive_main, session
from phalanx.launch import self_launch
from phalanx.launch.api import Launcher, job_env
from phalanx.launch.env import ReplicaEnv


def replicas(
    strategy: Any, world_size: int, *, before_start: Callable[[], None] = lambda: None
) -> tuple[Launcher | None, ReplicaEnv | None]:
    """The launcher and the identity of this process for ``strategy`` over ``world_size`` local replicas.

    Starts the other replicas when nobody has (``before_start`` runs just before, once per start):
    a notebook session for an interactive main, self-launch for a script. Returns ``(None, None)``
    for a single replica that nobody launched.

    Raises:
        LaunchError: the replicas cannot be started from here (inside pytest, an R console, ...).
    """
    if hooks.session is not None:  # a notebook's session: a new process group on its replicas
        if world_size == 1:
            return None, None
        return session.start(strategy, world_size)
    env = job_env()
    if env is not None:
        job = self_launch.current_job()
        # Replica 0 of a self-launched job holds its launcher, for every strategy of the program.
        return (job if job is not None and env is job.env else None), env
    if world_size == 1:
        return None, None
    before_start()
    if interactive_main():  # a notebook, the REPL, -c, stdin: no script to start again
        return session.start(strategy, world_size)
    job = self_launch.launch(world_size)  # once per program: later strategies run on the same replicas
    return job, job.env
