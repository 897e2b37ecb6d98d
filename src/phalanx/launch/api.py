"""How a synchronous strategy's replica processes come to exist: one interface, chosen in one place.

A strategy over N local devices needs N processes, this one among them. They come from one of:

* **the launcher's environment**: ``phalanx run``, torchrun, Slurm or a cluster spec started every
  process already and put each one's identity in its environment (:class:`ReplicaEnv`); nothing
  is started here;
* **self-launch** (:mod:`phalanx.launch.self_launch`): ``python train.py`` starts replicas
  1..N-1 as copies of its own command (an R program's, when Python is embedded in R);
* **a notebook session** (:mod:`phalanx.interactive.session`): a notebook, the REPL, ``python -c``
  or stdin has no script to start again; its replicas are forked (or spawned) and replay the cells;
* **a parameter-server cluster** is started from outside, task by task (``phalanx run --ps``,
  :mod:`phalanx.ps.launcher`), so a task finds its identity in its environment as in the first case.

:func:`phalanx.strategies.launchers.replicas` chooses among them, above what it chooses (as
Lightning's strategy configures its launcher); every strategy asks it, and nothing else starts
replicas (torch elastic's agent has one ``PContext``). What a strategy then holds is a
:class:`Launcher`: the object that started (and watches) its peers, or None where someone else did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from phalanx.launch.env import ReplicaEnv

if TYPE_CHECKING:
    from phalanx.launch.lifecycle import JobState


class Launcher(Protocol):
    """What started this process's local replicas and watches them, as a strategy uses it.

    One implementation per route, each over the one :class:`~phalanx.launch.supervisor.Supervisor`:
    :class:`~phalanx.launch.self_launch.ReplicaLauncher` (self-launch, and an embedding R host),
    :class:`~phalanx.launch.runner.ScriptLauncher` (``phalanx run``; it runs the job rather than
    serving a strategy), and a notebook's :class:`~phalanx.interactive.session.Session` over its
    :class:`~phalanx.launch.notebook.NotebookLauncher` (a notebook replica's
    :class:`~phalanx.interactive.replica.ReplicaSession` stands for it there).
    """

    @property
    def state(self) -> JobState:
        """Where the replicas are (:mod:`phalanx.launch.lifecycle`)."""

    def check_peers(self) -> None:
        """Raises a local replica's failure if one is known to have died (a rendezvous calls it
        while it waits, so that a dead peer ends the wait at once)."""

    def strategy_opened(self, strategy: Any) -> None:
        """A strategy now runs on these replicas."""

    def strategy_closed(self, strategy: Any) -> None:
        """``strategy.close()``: the last one closed may end the session (or, in an embedded host,
        the job, raising a replica's failure)."""


def job_env() -> ReplicaEnv | None:
    """This process's replica identity: from its launcher, or as replica 0 of the replicas it started."""
    env = ReplicaEnv.from_environ()
    if env is None:
        from phalanx.launch.self_launch import current_job

        job = current_job()
        env = job.env if job is not None else None
    return env
