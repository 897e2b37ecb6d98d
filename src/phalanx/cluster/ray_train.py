"""``RayTrainClusterResolver``: the layout of a Ray Train worker group, read from Ray's own context.

Ray Train's ``TorchTrainer`` starts one process (an actor) per worker, gives each its place
(``ray.train.get_context()``: world rank and size, local rank and size, node rank), sets
``MASTER_ADDR`` / ``MASTER_PORT`` and makes torch's default process group before it calls
``train_loop_per_worker``. A strategy made in that function finds the job here: the store of
Ray's group is joined (:mod:`phalanx.comm.rendezvous`), so there is no second rendezvous on the
port Ray's group already serves.

Nothing here imports Ray: a process is a Ray Train worker when ``ray.train`` is already loaded (a
worker runs inside it) and says so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from phalanx.cluster.placement import TaskPlacement, own_address_for
from phalanx.cluster.resolver import ClusterResolver, env_int
from phalanx.cluster.spec import ClusterSpec
from phalanx.errors import ClusterSpecError


def ray_train_context() -> Any | None:
    """Ray Train's context of this worker (``ray.train.get_context()``), or None outside a worker.

    Example:
        >>> ray_train_context() is None  # not a Ray Train worker (ray.train not even loaded)
        True
    """
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        context = train.get_context()
        context.get_world_size()  # outside a worker Ray's context raises here (or above)
    except Exception:  # noqa: BLE001 - whatever Ray raises, this is not a Ray Train worker
        return None
    return context


class RayTrainClusterResolver(ClusterResolver):
    """Reads a Ray Train worker's place from Ray's context, and the rendezvous Ray made.

    The task is ``worker:<node rank>`` (a node, as torchrun's resolver says); its processes are
    the Ray workers on that node. The rendezvous address is the one of Ray's own process group:
    ``MASTER_ADDR`` / ``MASTER_PORT`` (``TorchConfig(init_method="env")``, Ray's default), else the
    address of the store behind torch's default group (``init_method="tcp"``).

    Args:
        context: Ray Train's context (default: this worker's, ``ray.train.get_context()``).
        environ: where ``MASTER_ADDR`` / ``MASTER_PORT`` are read (default ``os.environ``).

    Raises:
        ClusterSpecError: this process is not a Ray Train worker, or Ray's process group has no
            address phalanx can join (named, with its value).

    Example:
        >>> class Context:  # what ray.train.get_context() answers in worker 3 of 4, 2 per node
        ...     def get_world_rank(self): return 3
        ...     def get_world_size(self): return 4
        ...     def get_local_rank(self): return 1
        ...     def get_local_world_size(self): return 2
        ...     def get_node_rank(self): return 1
        >>> r = RayTrainClusterResolver(Context(), environ={"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "41889"})
        >>> p = r.placement()
        >>> p.task_name, p.rank, p.world_size, p.num_nodes, p.master_addr, p.master_port
        ('worker:1', 3, 4, 2, '10.0.0.1', 41889)
    """

    lists_every_task = False  # Ray names only the rendezvous address

    def __init__(
        self, context: Any = None, *, environ: Mapping[str, str] | None = None, rpc_layer: str | None = None
    ) -> None:
        context = ray_train_context() if context is None else context
        if context is None:
            raise ClusterSpecError(
                "ray.train.get_context()",
                None,
                "this process is not a Ray Train worker",
                hint="make the strategy inside the train_loop_per_worker of a ray.train.torch.TorchTrainer",
            )
        self._rank = int(context.get_world_rank())
        self._world_size = int(context.get_world_size())
        self._local_rank = int(context.get_local_rank())
        self._local_world_size = int(context.get_local_world_size())
        self._node_rank = int(context.get_node_rank())
        # Ray does not say how many nodes; as torchrun's resolver, nodes hold local_world_size each.
        self._num_nodes = max(self._node_rank + 1, -(-self._world_size // max(self._local_world_size, 1)))
        self._master_addr, self._master_port = _rendezvous_address(os.environ if environ is None else environ)
        super().__init__("worker", self._node_rank, rpc_layer)

    def cluster_spec(self) -> ClusterSpec:
        """``{"worker": {0: "MASTER_ADDR:MASTER_PORT"}}``: the address of Ray's process group."""
        host = f"[{self._master_addr}]" if ":" in self._master_addr else self._master_addr
        return ClusterSpec({"worker": {0: f"{host}:{self._master_port}"}})

    def placement(self, local_world_size: int = 1, local_rank: int = 0) -> TaskPlacement:
        """The layout Ray gave its workers; the arguments are ignored (Ray fixes it)."""
        del local_world_size, local_rank
        return TaskPlacement(
            "worker",
            self._node_rank,
            self._rank,
            self._world_size,
            self._local_rank,
            self._local_world_size,
            self._node_rank,
            self._num_nodes,
            self._master_addr,
            self._master_port,
            own_address_for(self._master_addr),
        )


def _rendezvous_address(env: Mapping[str, str]) -> tuple[str, int]:
    """Where Ray's process group met: its variables, else the store of torch's default group."""
    addr = env.get("MASTER_ADDR", "").strip()
    if addr:
        return addr, env_int(env, "MASTER_PORT", low=1, high=65535)
    from phalanx._compat.torch import default_store_address  # torch: only where Ray set no variables

    found = default_store_address()
    if found is None:
        raise ClusterSpecError(
            "MASTER_ADDR",
            env.get("MASTER_ADDR"),
            "Ray Train set no rendezvous address and torch's default process group has no TCP store",
            hint="use Ray's default TorchConfig(init_method='env'), or TorchConfig(init_method='tcp')",
        )
    return found
