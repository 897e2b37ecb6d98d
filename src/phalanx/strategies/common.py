"""The machinery the synchronous strategies share: :class:`SyncExtended`.

Each synchronous strategy pairs a thin ``XStrategy`` with an ``XExtended`` that builds its own
machinery, as TF's ``MirroredExtended`` does: the replicas' devices, this process's identity (from
the launcher, or by starting the other replicas now), the CUDA device, the communicator, the CPU
threads and closing at exit. The steps live here, as methods of the base class, so that each
strategy only says what differs.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from phalanx import config
from phalanx.cluster.placement import own_address_for
from phalanx.cluster.ray_train import ray_train_context
from phalanx.comm.communicator import Communicator, GroupSpec, LocalCommunicator
from phalanx.comm.elastic import ElasticCommunicator
from phalanx.comm.group_communicator import ProcessGroupCommunicator
from phalanx.core.extended import StrategyExtended
from phalanx.core.strategy import close_at_exit
from phalanx.devices import LogicalDevice, canonicalize, default_devices
from phalanx.errors import ClusterSpecError, DuplicateDeviceError, InvalidDeviceError
from phalanx.launch import replica_hooks
from phalanx.launch.cores import cpu_oversubscription_warning
from phalanx.launch.env import ReplicaEnv, free_port
from phalanx.launch.launcher import Launcher, engine
from phalanx.strategies.launchers import replicas


def local_devices(devices: Any, env: ReplicaEnv | None, what: str = "devices") -> list[LogicalDevice]:
    """The replicas' devices on this host: as given, else one per process the launcher started,
    else every visible GPU or the CPU.

    Raises:
        InvalidDeviceError: a device is malformed, absent or repeated, or none is given.
    """
    if devices is None:
        if env is None:
            return default_devices()
        kind = "cuda" if torch.cuda.device_count() >= env.local_world_size else "cpu"
        return [LogicalDevice(kind, i) for i in range(env.local_world_size)]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    given = list(devices)
    parsed = [canonicalize(d) for d in given]
    if not parsed:
        raise InvalidDeviceError(devices, hint=f"give at least one device in `{what}`, e.g. ['cpu:0', 'cpu:1']")
    for i, device in enumerate(parsed):
        if device in parsed[:i]:
            first = given[parsed.index(device)]
            raise DuplicateDeviceError(given[i], given, first=first, what=what)
    return parsed


def _warn_if_cpu_oversubscribed(strategy: str, devices: list[LogicalDevice]) -> None:
    """Says on stderr, as ``phalanx run -n N`` does, when ``devices`` are more CPU replicas than cores."""
    cpus = sum(1 for d in devices if d.type == "cpu")
    warning = cpu_oversubscription_warning(cpus, who="phalanx", what=strategy, fewer="{cores} replica(s)")
    if warning:
        print(warning, file=sys.stderr, flush=True)


_generations: dict[tuple[str, int], int] = {}  # (master address, port) -> communicators created


class SyncExtended(StrategyExtended):
    """Base of the synchronous strategies' machinery; subclasses call its steps in ``__init__``.

    The order a subclass follows: :meth:`_replica_env` (who this process is, starting the other
    replicas if needed), :meth:`_select_device`, :meth:`_build_communicator`,
    :meth:`_configure_cpu_threads`, ``StrategyExtended.__init__``, :meth:`_close_at_exit`.
    """

    _launcher: Launcher | None = None  # what started the other replicas, kept alive with the strategy

    def _replica_env(self, devices: list[LogicalDevice], what: str = "devices") -> ReplicaEnv | None:
        """This process's identity: from the launcher, or by starting the other replicas now
        (:func:`phalanx.strategies.launchers.replicas` chooses how).

        Raises:
            ClusterSpecError: the launcher started a different number of replicas than ``devices``.
        """
        name = type(self).__name__.removesuffix("Extended") + "Strategy"
        self._launcher, env = replicas(
            self, len(devices), before_start=lambda: _warn_if_cpu_oversubscribed(name, devices)
        )
        if env is not None and env.local_world_size != len(devices):
            started_by = engine()
            if started_by is not None and started_by.env == env:
                raise ClusterSpecError(
                    started_by.local_key,
                    started_by.local_value,
                    f"{started_by.name} runs {env.local_world_size} of this job's processes on this host, one replica "
                    f"each, but {name} was given {len(devices)} devices {[str(d) for d in devices]}",
                    hint=started_by.hint,
                )
            raise ClusterSpecError(
                what,
                [str(d) for d in devices],
                f"the launcher started {env.local_world_size} replica processes on this host",
                hint="pass as many devices as `phalanx run -n` starts, or none",
            )
        if self._launcher is not None:  # the last strategy closed may end the session or the job
            self._launcher.strategy_opened(self)
        return env

    @staticmethod
    def _backend_for(device: LogicalDevice) -> str:
        """NCCL where the replicas are GPUs (as TF's MirroredStrategy defaults to NcclAllReduce), gloo on CPUs.

        The communicator routes CPU tensors (control values, host tensors) through gloo beside it.
        """
        return "nccl" if device.type == "cuda" else "gloo"

    @staticmethod
    def _select_device(device: LogicalDevice) -> None:
        """Makes the replica's GPU the current CUDA device (Keras and torch create tensors there)."""
        if device.type == "cuda":
            torch.cuda.set_device(device.index)

    def _build_communicator(
        self,
        env: ReplicaEnv | None,
        *,
        timeout: float | None = None,
        bind_addr: str | None = None,
        names: tuple[str, ...] = (),
        addresses: tuple[str, ...] = (),
        fingerprint: tuple[tuple[str, Any], ...] = (),
        backend: str = "gloo",
        elastic: bool = False,
    ) -> Any:
        """The communicator of this process: local for one replica, gloo/NCCL otherwise.

        ``names`` and ``addresses`` (``host:port``, from a cluster spec) per rank are how messages
        name the other tasks: errors, and the rendezvous notice for peers that are late.

        The program's k-th multi-replica communicator of a job uses the job's store under its own
        key prefix, so that strategies created one after another (or alive together) run on the
        same processes; every process creates its strategies in the same order, so they agree on k.

        With ``PHALANX_MIN_NPROC`` (``phalanx run --min-nproc``), a strategy that can go on without
        lost replicas (``elastic``: Mirrored, MultiWorkerMirrored) gets an
        :class:`~phalanx.comm.elastic.ElasticCommunicator`; any other refuses it.

        Raises:
            ClusterSpecError: ``PHALANX_MIN_NPROC`` is above the job's size, or set for a strategy
                that cannot go on without a replica.
        """
        replica_hooks.install()
        settings = config.settings()
        if env is None or env.world_size == 1:
            if not settings.single_replica_collectives:
                return LocalCommunicator()  # one replica: every collective is the identity, for free
            if env is None:  # a job of one, not launched: it serves its own store
                env = ReplicaEnv(0, 1, 0, 1, "127.0.0.1", free_port())
        job = (env.master_addr, env.master_port)
        generation = _generations.get(job, 0)
        _generations[job] = generation + 1
        spec = GroupSpec(
            rank=env.rank,
            world_size=env.world_size,
            master_addr=env.master_addr,
            master_port=env.master_port,
            # With no address from a cluster spec, listen on the local address that routes to the master
            # (loopback for a single host): never on all interfaces, never on an address peers cannot reach.
            bind_addr=bind_addr or own_address_for(env.master_addr),
            names=names,
            timeout=timeout or settings.collective_timeout,
            rendezvous_timeout=settings.rendezvous_timeout,
            rendezvous_notice=settings.rendezvous_notice,
            addresses=addresses,
            fingerprint=fingerprint,
            store_prefix=f"strategy{generation}/" if generation else "",
            # A launcher that can tell a dead local replica (an interactive session) ends the
            # rendezvous with that replica's error as soon as it knows.
            peer_check=self._launcher.check_peers if self._launcher is not None else None,
            # Where a failed collective's diagnosis goes for the launcher to print (a phalanx launcher's run).
            run_dir=env.log_dir,
            launcher_prints=bool(env.log_dir)
            and (
                os.environ.get("PHALANX_DIAGNOSIS_DIR") == env.log_dir
                or getattr(self._launcher, "prints_diagnosis", False)
            ),
            recorder_size=settings.flight_recorder,
        )
        if settings.min_nproc and env.world_size > 1:
            name = type(self).__name__.removesuffix("Extended") + "Strategy"
            if not elastic:
                raise ClusterSpecError(
                    "PHALANX_MIN_NPROC",
                    settings.min_nproc,
                    f"{name} cannot go on without a lost replica",
                    hint="an elastic job (phalanx run --min-nproc) runs Mirrored or MultiWorkerMirroredStrategy",
                )
            if ray_train_context() is not None:
                raise ClusterSpecError(
                    "PHALANX_MIN_NPROC",
                    settings.min_nproc,
                    "Ray Train restarts its whole worker group after a failure, and made the process group",
                    hint="give the TorchTrainer RunConfig(failure_config=FailureConfig(max_failures=N)) and "
                    "resume with phalanx.ray_train.restore (docs/elastic.md)",
                )
            if settings.min_nproc > env.world_size:
                raise ClusterSpecError(
                    "PHALANX_MIN_NPROC",
                    settings.min_nproc,
                    f"the job has {env.world_size} replicas",
                    hint="the minimum must be at most the number of replicas started",
                )
            join_as = settings.join_as if settings.join_as >= 0 else None
            return ElasticCommunicator(spec, min_size=settings.min_nproc, backend=backend, join_as=join_as)
        return ProcessGroupCommunicator(spec, backend=backend)

    @staticmethod
    def _configure_cpu_threads(comm: Communicator, device_type: str) -> None:
        """Gives each CPU replica its share of the cores, unless the user chose (OMP_NUM_THREADS).

        Counts every process of the job on this host (after rendezvous), so two TF_CONFIG workers
        started separately on one machine do not each claim all of its cores.
        """
        if device_type != "cpu" or "OMP_NUM_THREADS" in os.environ or comm.world_size == 1:
            return
        here = comm.host_of(comm.rank)
        on_this_host = sum(1 for r in range(comm.world_size) if comm.host_of(r) == here)
        if on_this_host > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // on_this_host))

    def _close_at_exit(self) -> None:
        """Closes the strategy (else this machinery) when the interpreter exits, if nobody did before."""
        close_at_exit(self)
