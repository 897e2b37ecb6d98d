"""MultiWorkerMirroredStrategy: synchronous training across hosts (``tf.distribute.MultiWorkerMirroredStrategy``).

Who is who comes from a cluster resolver: ``TF_CONFIG`` (Kubeflow TFJob, TF tooling), the
torchrun / PyTorchJob variables, Slurm, or ``phalanx run --nnodes``. A worker (host) with k
devices runs k replica processes (``phalanx run -n k``); global ranks follow the cluster spec's
task order (chief, then workers), so every host derives the same numbering. At rendezvous every
process publishes a fingerprint of its cluster description; processes whose descriptions
disagree all fail with :class:`~phalanx.errors.ClusterSpecMismatchError` naming the field.

Example (each worker runs the same script with its own TF_CONFIG)::

    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
        "task": {"type": "worker", "index": 0}})
    strategy = phalanx.MultiWorkerMirroredStrategy(
        communication_options=phalanx.experimental.CommunicationOptions(timeout_seconds=60))
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.cluster import ClusterResolver, SimpleClusterResolver, TaskPlacement, resolve_from_environment
from phalanx.cluster.placement import own_address_for
from phalanx.cluster.spec import ClusterSpec
from phalanx.cluster.validation import validate_cluster
from phalanx.comm.cross_device_ops import NcclAllReduce
from phalanx.comm.reducer import DEFAULT_BUCKET_BYTES
from phalanx.core.extended import InputSharding, tf_device_name
from phalanx.core.strategy import Strategy
from phalanx.devices import LogicalDevice
from phalanx.errors import ClusterSpecError, InvalidDeviceError
from phalanx.launch import mismatch
from phalanx.launch.env import ReplicaEnv
from phalanx.launch.launcher import job_env
from phalanx.strategies.common import SyncExtended


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use (TF 2.0 called it ``CollectiveCommunication``)."""

    AUTO = "AUTO"
    RING = "RING"  # gloo on CPUs (shared memory within a host, gloo between hosts): no NCCL
    NCCL = "NCCL"


CollectiveCommunication = CommunicationImplementation


@dataclass(frozen=True)
class CommunicationOptions:
    """Options of cross-replica collectives (``tf.distribute.experimental.CommunicationOptions``).

    Attributes:
        bytes_per_pack: gradients are packed into all-reduces of about this many bytes (0: 25 MB).
        timeout_seconds: bound on every collective; a peer that does not take part within it is
            reported as unavailable (None: 300 s, or ``PHALANX_COLLECTIVE_TIMEOUT``).
        implementation: AUTO (NCCL with GPUs, else RING), RING or NCCL.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be a non-negative int; received {self.bytes_per_pack!r}")
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive; received {self.timeout_seconds!r}")
        object.__setattr__(self, "implementation", CommunicationImplementation(self.implementation))


def _placement(resolver: ClusterResolver | None, env: ReplicaEnv | None) -> TaskPlacement:
    local_world_size = env.local_world_size if env is not None else 1
    local_rank = env.local_rank if env is not None else 0
    if resolver is not None:
        return resolver.placement(local_world_size, local_rank)
    if env is not None:
        return TaskPlacement(
            "worker",
            env.node_rank,
            env.rank,
            env.world_size,
            env.local_rank,
            env.local_world_size,
            env.node_rank,
            env.num_nodes,
            env.master_addr,
            env.master_port,
            own_address_for(env.master_addr),
        )
    return TaskPlacement("worker", 0, 0, 1, 0, 1, 0, 1, "127.0.0.1", 0, "127.0.0.1")


def _rank_addresses(spec: ClusterSpec, placement: TaskPlacement) -> tuple[str, ...]:
    """The cluster spec's ``host:port`` of the task that runs each global rank, as the user wrote it."""
    names = placement.sync_task_names  # empty (a Slurm or launcher placement): worker:<node>, as describe_rank says
    addresses = []
    for node in range(placement.num_nodes):
        job, index = (names[node] if node < len(names) else f"worker:{node}").split(":")
        try:
            address = spec.task_address(job, int(index))
        except ClusterSpecError:  # an address only decorates the notice: never fail over it
            address = ""
        addresses += [address] * placement.local_world_size
    return tuple(addresses)


class MultiWorkerMirroredExtended(SyncExtended):
    """The machinery of :class:`MultiWorkerMirroredStrategy`: every device of every worker.

    Args:
        cluster_resolver, communication_options: as :class:`MultiWorkerMirroredStrategy`'s.

    Attributes:
        placement: this process's place in the cluster.
        communication_options: the options in effect.
        cluster_resolver: the resolver the strategy reports (a single-worker one when none was found).
    """

    def __init__(
        self, cluster_resolver: ClusterResolver | None = None, communication_options: CommunicationOptions | None = None
    ) -> None:
        options = communication_options or CommunicationOptions()
        env = job_env()
        resolver = cluster_resolver if cluster_resolver is not None else resolve_from_environment()
        if resolver is None and env is None:
            mismatch.lone_multi_worker("MultiWorkerMirroredStrategy")  # one replica, said once
        spec = resolver.cluster_spec() if resolver is not None else None
        if spec and resolver.lists_every_task:  # a partial spec (torchrun) cannot list this task
            validate_cluster(spec, resolver.task_type, resolver.task_id, allow_ps=False)
        placement = _placement(resolver, env)
        if not placement.in_sync_group:
            raise ClusterSpecError(
                "task.type", placement.task_type, "MultiWorkerMirroredStrategy runs only on 'chief' and 'worker' tasks"
            )
        gpus = torch.cuda.device_count()
        # RING asked for explicitly on a host with fewer GPUs than local replicas: the replicas share
        # the GPUs (gloo reduces CUDA tensors through the host), the way to run several replicas on
        # one GPU (a notebook's single GPU, a test). NCCL cannot share a GPU between ranks.
        ring = options.implementation is CommunicationImplementation.RING
        use_gpu = gpus >= placement.local_world_size or (ring and gpus > 0)
        if options.implementation is CommunicationImplementation.NCCL and not use_gpu:
            raise InvalidDeviceError(
                "NCCL", hint="NCCL needs one GPU per local replica; use CommunicationImplementation.RING (gloo) on CPUs"
            )
        backend = "nccl" if use_gpu and options.implementation is not CommunicationImplementation.RING else "gloo"
        index = placement.local_rank % gpus if use_gpu else placement.local_rank
        device = LogicalDevice("cuda" if use_gpu else "cpu", index)
        self._select_device(device)
        if placement.world_size > 1 and placement.master_port == 0:
            raise ClusterSpecError(
                "master_port",
                0,
                "a multi-process job needs the chief's port",
                hint="set TF_CONFIG, MASTER_ADDR/MASTER_PORT, or use phalanx run",
            )
        fingerprint: tuple[tuple[str, Any], ...] = tuple(sorted(placement.fingerprint().items()))
        if spec and resolver.lists_every_task:  # a partial spec names the master as each node sees it
            fingerprint += tuple(
                (f"cluster.{job}", spec.job_tasks(job)) for job in ("chief", "worker") if job in spec.jobs
            )
        run_env = ReplicaEnv(
            placement.rank,
            placement.world_size,
            placement.local_rank,
            placement.local_world_size,
            placement.master_addr,
            placement.master_port,
            placement.node_rank,
            placement.num_nodes,
            # Under a phalanx launcher (phalanx run with TF_CONFIG), its run directory: a failed
            # collective's diagnosis goes there for the launcher to print.
            log_dir=env.log_dir if env is not None else "",
        )
        comm = self._build_communicator(
            run_env,
            timeout=options.timeout_seconds,
            bind_addr=placement.bind_addr,
            names=tuple(placement.describe_rank(r) for r in range(placement.world_size)),
            addresses=_rank_addresses(spec, placement) if spec and resolver.lists_every_task else (),
            fingerprint=fingerprint,
            backend=backend,
            elastic=True,
        )
        self._configure_cpu_threads(comm, device.type)
        task = f"/job:{placement.task_type}/replica:0/task:{placement.task_id}"
        local = tuple(tf_device_name(LogicalDevice(device.type, i), task) for i in range(placement.local_world_size))
        # Workers may hold inputs of different lengths: agree each step on who still has data.
        sharding = InputSharding(
            num_workers=placement.num_nodes,
            worker_index=max(placement.node_rank, 0),
            agree_on_end=placement.world_size > 1,
        )
        super().__init__(
            comm,
            device,
            local,
            local,
            NcclAllReduce(),
            options.bytes_per_pack or DEFAULT_BUCKET_BYTES,
            input_sharding=sharding,
        )
        self.placement = placement
        self.communication_options = options
        if resolver is None:
            resolver = (
                SimpleClusterResolver(
                    {"worker": [f"{placement.master_addr}:{placement.master_port}"]}, task_type="worker", task_id=0
                )
                if placement.num_nodes == 1
                else None
            )
        self.cluster_resolver = resolver
        self._close_at_exit()


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over every device of every worker.

    Args:
        cluster_resolver: who is who; default: detected from the environment (TF_CONFIG, torchrun,
            Slurm, ``phalanx run``), else a single worker.
        communication_options: :class:`CommunicationOptions`.

    Raises:
        ClusterSpecError: the cluster description is malformed (checked before any network I/O),
            or it gives this strategy a ``ps`` job.
        ClusterSpecMismatchError, RendezvousTimeoutError: at rendezvous.
    """

    def __init__(
        self, cluster_resolver: ClusterResolver | None = None, communication_options: CommunicationOptions | None = None
    ) -> None:
        extended = MultiWorkerMirroredExtended(cluster_resolver, communication_options)
        self._placement = extended.placement
        self._communication_options = extended.communication_options
        super().__init__(extended, cluster_resolver=extended.cluster_resolver)
