"""``ClusterResolver``: TensorFlow's interface for "who is in the job, and who am I"."""

from __future__ import annotations

import abc
from collections.abc import Mapping

from phalanx.cluster.placement import TaskPlacement, placement_from_spec
from phalanx.cluster.spec import ClusterSpec
from phalanx.errors import ClusterSpecError


def format_master_url(address: str, rpc_layer: str | None) -> str:
    """``"grpc://host:port"`` when an RPC layer is given, else the bare address (as TF does)."""
    return f"{rpc_layer}://{address}" if rpc_layer else address


def env_int(
    environ: Mapping[str, str],
    name: str,
    default: int | None = None,
    *,
    low: int = 0,
    high: int | None = None,
    what: str = "",
) -> int:
    """Read an integer environment variable and check ``low <= value <= high``.

    Raises:
        ClusterSpecError: naming the variable and its value when it is missing (and has no
            default), not an integer, or out of range.
    """
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ClusterSpecError(name, raw, "is not set", hint="set it, or launch with torchrun / srun")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ClusterSpecError(name, raw, "is not an integer", hint=what or f"set {name} to a number") from None
    if value < low or (high is not None and value > high):
        bounds = f"{low}..{high}" if high is not None else f">= {low}"
        raise ClusterSpecError(name, raw, f"must be in {bounds}", hint=what or f"set {name} in {bounds}")
    return value


class ClusterResolver(abc.ABC):
    """Describes the cluster and this task's place in it, with tf.distribute's API.

    Subclasses implement :meth:`cluster_spec`; resolvers whose environment fixes the rank layout
    (torchrun, Slurm) also override :meth:`placement`.

    Example:
        >>> from phalanx.cluster import SimpleClusterResolver
        >>> r = SimpleClusterResolver({"worker": ["w0:2222", "w1:2222"]}, task_type="worker", task_id=1)
        >>> r.master("worker", 1), r.placement(local_world_size=2, local_rank=1).rank
        ('w1:2222', 3)
    """

    #: Whether :meth:`cluster_spec` names every task. torchrun's and PyTorchJob's variables name
    #: only the master, so their resolver's spec is partial and this task need not appear in it.
    lists_every_task: bool = True

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str = "",
    ) -> None:
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster this task belongs to."""

    @property
    def task_type(self) -> str | None:
        """This task's job name, e.g. ``"worker"``."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This task's index within its job."""
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The RPC protocol prefix for :meth:`master`, e.g. ``"grpc"``; None for none."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        """The environment name TF_CONFIG gives (``"cloud"``, ``"google"``); ``""`` otherwise."""
        return self._environment

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: object = None
    ) -> dict[str, int]:
        """Accelerators on this host, e.g. ``{"GPU": 8}``; the arguments exist for TF parity."""
        del task_type, task_id, config_proto
        import torch  # imported late: the cluster layer is otherwise stdlib-only

        return {"GPU": torch.cuda.device_count()}

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of a task (this one by default), or ``""`` when it is not known."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if task_type is None or task_id is None:
            return ""
        return format_master_url(self.cluster_spec().task_address(task_type, task_id), rpc_layer or self.rpc_layer)

    def placement(self, local_world_size: int = 1, local_rank: int = 0) -> TaskPlacement:
        """This process's rank layout, with ``local_world_size`` processes on each task."""
        return placement_from_spec(
            self.cluster_spec(),
            self.task_type,
            self.task_id,
            local_world_size=local_world_size,
            local_rank=local_rank,
        )
