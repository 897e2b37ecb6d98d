"""``TorchElasticClusterResolver``: the layout torchrun and Kubeflow PyTorchJob put in the env.

torchrun sets every variable per process (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A PyTorchJob started without torchrun
sets only RANK / WORLD_SIZE / MASTER_*, one per pod: then RANK is the node and
:meth:`~TorchElasticClusterResolver.placement`'s arguments give the processes per node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from phalanx.cluster.placement import (
    TaskPlacement,
    check_local_layout,
    host_address,
    is_loopback,
    own_address_for,
    resolve_address,
)
from phalanx.cluster.resolver import ClusterResolver, env_int, format_master_url
from phalanx.cluster.spec import ClusterSpec
from phalanx.errors import ClusterSpecError

_TORCH_DEFAULT_PORT = 29500  # torch.distributed's own default when MASTER_PORT is unset


class TorchElasticClusterResolver(ClusterResolver):
    """Reads and validates the torchrun environment at construction.

    The task is ``worker:<node rank>``. torchrun does not tell a node the other nodes'
    addresses, so :meth:`cluster_spec` holds only ``worker:0`` at MASTER_ADDR:MASTER_PORT.

    Raises:
        ClusterSpecError: a variable is missing, not an integer or out of range (named, with
            its value).

    Example:
        >>> env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        ...        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
        >>> p = TorchElasticClusterResolver(environ=env).placement()
        >>> p.task_name, p.rank, p.node_rank, p.num_nodes, p.master_port
        ('worker:1', 3, 1, 2, 29400)
    """

    lists_every_task = False  # the variables name only the master

    def __init__(self, *, environ: Mapping[str, str] | None = None, rpc_layer: str | None = None) -> None:
        env = os.environ if environ is None else environ
        self._world_size = env_int(env, "WORLD_SIZE", low=1)
        self._rank = env_int(env, "RANK", high=self._world_size - 1, what=f"WORLD_SIZE is {self._world_size}")
        # LOCAL_WORLD_SIZE marks torchrun's per-process variables; without it RANK is a node.
        self._per_process = bool(env.get("LOCAL_WORLD_SIZE", "").strip())
        local_ws = env_int(env, "LOCAL_WORLD_SIZE", 1, low=1)
        self._local_world_size = local_ws
        self._local_rank = (
            env_int(env, "LOCAL_RANK", high=local_ws - 1, what=f"LOCAL_WORLD_SIZE is {local_ws}")
            if self._per_process
            else 0
        )
        default_nodes = -(-self._world_size // local_ws)  # ceil: the last node may be partial
        self._num_nodes = env_int(env, "GROUP_WORLD_SIZE", default_nodes, low=1)
        node_var = "GROUP_RANK" if env.get("GROUP_RANK", "").strip() else "NODE_RANK"
        self._node_rank = env_int(
            env,
            node_var,
            self._rank // local_ws,
            high=self._num_nodes - 1,
            what=f"there are {self._num_nodes} nodes",
        )
        self._master_addr = env.get("MASTER_ADDR", "").strip()
        if not self._master_addr or " " in self._master_addr:
            raise ClusterSpecError(
                "MASTER_ADDR",
                env.get("MASTER_ADDR"),
                "must be a host name or IP",
                hint="set it to the address of the rank-0 node",
            )
        self._master_port = env_int(env, "MASTER_PORT", _TORCH_DEFAULT_PORT, low=1, high=65535)
        super().__init__("worker", self._node_rank, rpc_layer)

    def cluster_spec(self) -> ClusterSpec:
        """``{"worker": {0: "MASTER_ADDR:MASTER_PORT"}}``: all this environment tells."""
        host = f"[{self._master_addr}]" if ":" in self._master_addr else self._master_addr
        return ClusterSpec({"worker": {0: f"{host}:{self._master_port}"}})

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The rendezvous address ``MASTER_ADDR:MASTER_PORT`` unless a task is asked for."""
        if task_type is not None and task_id is not None:
            return super().master(task_type, task_id, rpc_layer)
        return format_master_url(self.cluster_spec().task_address("worker", 0), rpc_layer or self.rpc_layer)

    def placement(self, local_world_size: int = 1, local_rank: int = 0) -> TaskPlacement:
        """The layout from the environment; the arguments only fill in what it leaves out."""
        if self._per_process:
            lws, lr, rank, world = self._local_world_size, self._local_rank, self._rank, self._world_size
        else:  # one env per node: RANK / WORLD_SIZE count nodes, the arguments count processes
            lws, lr = local_world_size, local_rank
            check_local_layout(lws, lr)
            rank, world = self._rank * lws + lr, self._world_size * lws
        master = self._master_addr
        if self._num_nodes > 1:
            # PyTorchJob gives its master pod MASTER_ADDR=localhost and the others the master's
            # service name. Listening on loopback would shut the other nodes out, so the master
            # node listens on (and its processes meet at) its host name's address, the pod's IP in
            # Kubernetes; the other nodes resolve the name, so every node names the master alike.
            if is_loopback(master):
                master = (host_address() if self._node_rank == 0 else None) or master
            else:
                master = resolve_address(master) or master
        return TaskPlacement(
            "worker",
            self._node_rank,
            rank,
            world,
            lr,
            lws,
            self._node_rank,
            self._num_nodes,
            master,
            self._master_port,
            own_address_for(master),
        )
