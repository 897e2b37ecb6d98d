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
  :mod:`phalanx.ps.cluster_launcher`), so a task finds its identity in its environment as in the first case.

:func:`phalanx.strategies.launchers.replicas` chooses among them, above what it chooses (as
Lightning's strategy configures its launcher); every strategy asks it, and nothing else starts
replicas (torch elastic's agent has one ``PContext``). What a strategy then holds is a
:class:`Launcher`: the object that started (and watches) its peers, or None where someone else did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.launch.env import ReplicaEnv

if TYPE_CHECKING:
    from phalanx.launch.lifecycle import JobState


class Launcher(Protocol):
    """What started this process's local replicas and watches them, as a strategy uses it.

    One implementation per route, each over the one :class:`~phalanx.launch.supervisor.Supervisor`:
    :class:`~phalanx.launch.self_launch.ReplicaLauncher` (self-launch, and an embedding R host),
    :class:`~phalanx.launch.runner.ScriptLauncher` (``phalanx run``; it runs the job rather than
    serving a strategy), a notebook's :class:`~phalanx.interactive.session.Session` over its
    :class:`~phalanx.launch.notebook.NotebookLauncher` (a notebook replica's
    :class:`~phalanx.interactive.replica.ReplicaSession` stands for it there), and the
    parameter-server cluster's :class:`~phalanx.ps.cluster_launcher.ClusterLauncher` (``phalanx run
    --ps``; ``launch/`` never imports it). Each ends with a :class:`~phalanx.launch.lifecycle.RunResult`.
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


@dataclass(frozen=True)
class Engine:
    """A cluster engine that started this process as one of a job's (Ray Train's worker group, a Slurm step).

    Attributes:
        name: the engine, as messages name it (``"Ray Train"``).
        env: this process's replica identity in the engine's job.
        local_key, local_value: where the engine says how many of the job's processes run on this
            host, and what it says: the value a strategy's device list must match.
        hint: how to give the engine that many processes per host.
    """

    name: str
    env: ReplicaEnv
    local_key: str
    local_value: str
    hint: str


def engine() -> Engine | None:
    """The engine that started this process as a replica of its job, or None.

    A Ray Train worker (``train_loop_per_worker`` of a ``TorchTrainer``) is one replica of the
    Ray job, and so is each task of a Slurm step of several tasks (``srun``): ``MirroredStrategy()``
    there runs one replica per worker or task, as under ``phalanx run``, instead of starting
    replicas of its own in each (separate jobs that would never meet).
    """
    from phalanx.cluster.ray_train import RayTrainClusterResolver, ray_train_context

    if ray_train_context() is not None:
        p = RayTrainClusterResolver().placement()
        name, key = "Ray Train", "ray.train.get_context().get_local_world_size()"
        hint = (
            "give each node as many Ray Train workers as the strategy has devices (ScalingConfig(num_workers=...), "
            "resources_per_worker), or make the strategy without a device list: one replica per worker"
        )
    else:
        from phalanx.cluster.detect import resolve_from_environment
        from phalanx.cluster.slurm import SlurmClusterResolver

        resolver = resolve_from_environment()  # a Slurm step of one task (srun --pty) is no engine's job
        if not isinstance(resolver, SlurmClusterResolver):
            return None
        p = resolver.placement()
        name, key = "Slurm", "SLURM_NTASKS_PER_NODE"
        hint = (
            "run as many tasks per node as the strategy has devices (srun --ntasks-per-node=<devices>), or make "
            "the strategy without a device list: one replica per task"
        )
    env = ReplicaEnv(
        p.rank, p.world_size, p.local_rank, p.local_world_size, p.master_addr, p.master_port, p.node_rank, p.num_nodes
    )
    return Engine(name, env, key, str(p.local_world_size), hint)


def job_env() -> ReplicaEnv | None:
    """This process's replica identity: from its launcher, as replica 0 of the replicas it started,
    or from the engine whose job it belongs to (:func:`engine`)."""
    env = ReplicaEnv.from_environ()
    if env is None:
        from phalanx.launch.self_launch import current_job

        job = current_job()
        env = job.env if job is not None else None
    if env is None:
        found = engine()
        env = found.env if found is not None else None
    return env
