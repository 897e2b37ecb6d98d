"""The one place that chooses how a synchronous strategy's replica processes come to exist.

It sits above the launchers it chooses among (Lightning's strategy configures its own launcher the
same way): the launcher's environment and self-launch (:mod:`phalanx.launch`), and a notebook
session (:mod:`phalanx.interactive.session`). :mod:`phalanx.launch.launcher` says what each route is and
what a strategy holds afterwards (a :class:`~phalanx.launch.launcher.Launcher`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.interactive import session
from phalanx.launch import mode, self_launch
from phalanx.launch.env import ReplicaEnv
from phalanx.launch.launcher import Launcher
from phalanx.launch.mode import JobMode


def replicas(
    strategy: Any, world_size: int, *, before_start: Callable[[], None] = lambda: None
) -> tuple[Launcher | None, ReplicaEnv | None]:
    """The launcher and the identity of this process for ``strategy`` over ``world_size`` local replicas.

    Reads how this process runs (:func:`phalanx.launch.mode.current`). Starts the other replicas
    when nobody has (``before_start`` runs just before, once per start): a notebook session for an
    interactive main, self-launch for a script (or an embedding host's program). Returns
    ``(None, None)`` for a single replica that nobody launched.

    Raises:
        LaunchError: the replicas cannot be started from here (inside pytest, an R console, ...).
    """
    role = mode.current()
    if role.mode.notebook:  # a notebook's session: a new process group on its replicas
        if world_size == 1:
            return None, None
        return session.start(strategy, world_size)
    if role.env is not None:
        # Replica 0 of a self-launched job holds its launcher, for every strategy of the program.
        return role.launcher, role.env
    if world_size == 1:
        return None, None
    before_start()
    if mode.starting_mode() is JobMode.NOTEBOOK_SESSION:
        return session.start(strategy, world_size)
    job = self_launch.launch(world_size)  # once per program: later strategies run on the same replicas
    return job, job.env
