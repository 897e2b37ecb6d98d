"""``SimpleClusterResolver``: a resolver from values given in code."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.cluster.resolver import ClusterResolver, format_master_url
from phalanx.cluster.spec import ClusterSpec


class SimpleClusterResolver(ClusterResolver):
    """Returns the cluster, task and accelerators it was built with (as TF's does).

    Args:
        cluster_spec: a ClusterSpec, or a dict accepted by ClusterSpec.
        master: what :meth:`master` returns when no task is asked for.
        task_type: this task's job.
        task_id: this task's index.
        environment: the environment name.
        num_accelerators: e.g. ``{"GPU": 2}``; ``None`` counts this host's GPUs.
        rpc_layer: prefix for :meth:`master`, e.g. ``"grpc"``.

    Example:
        >>> r = SimpleClusterResolver({"chief": ["c:1"], "worker": ["w:1"]}, master="c:1",
        ...                           task_type="worker", task_id=0, num_accelerators={"GPU": 2})
        >>> r.master(), r.master("worker", 0, rpc_layer="grpc"), r.num_accelerators()
        ('c:1', 'grpc://w:1', {'GPU': 2})
        >>> r.placement().rank, r.placement().world_size
        (1, 2)
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Any],
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: Mapping[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        super().__init__(task_type, task_id, rpc_layer, environment)
        self._cluster_spec = ClusterSpec(cluster_spec)
        self._master = master
        self._num_accelerators = None if num_accelerators is None else dict(num_accelerators)

    def cluster_spec(self) -> ClusterSpec:
        """The cluster given at construction."""
        return self._cluster_spec

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The given task's address, or the ``master`` given at construction."""
        if task_type is not None and task_id is not None:
            return super().master(task_type, task_id, rpc_layer)
        return format_master_url(self._master, rpc_layer or self.rpc_layer) if self._master else ""

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: object = None
    ) -> dict[str, int]:
        """The accelerators given at construction, else this host's GPUs."""
        if self._num_accelerators is None:
            return super().num_accelerators(task_type, task_id, config_proto)
        return dict(self._num_accelerators)
