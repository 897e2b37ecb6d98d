"""Where one process sits in a job: its rank, its node, and whom to rendezvous with.

The rank layout is the one torchrun uses: node ``n`` runs ranks
``n * local_world_size .. (n + 1) * local_world_size - 1``. For a TF_CONFIG-style cluster the
nodes are the synchronous tasks in the order ``chief`` (if any), then ``worker`` by index.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import socket
from dataclasses import asdict, dataclass
from typing import Any

from phalanx.cluster.spec import ClusterSpec
from phalanx.cluster.validation import SYNC_JOBS, split_address
from phalanx.errors import ClusterSpecError, ClusterSpecMismatchError

# Order matters: compare_fingerprints reports the first field that differs.
FINGERPRINT_FIELDS = (
    "world_size",
    "num_nodes",
    "local_world_size",
    "master_addr",
    "master_port",
    "cluster_digest",
)


@dataclass(frozen=True)
class TaskPlacement:
    """One process's place in a job.

    ``rank`` is ``-1`` for tasks outside the synchronous group (``ps``, ``evaluator``); their
    ``master_*`` fields still point at the group's first task. ``master_port == 0`` means no
    cluster was given (a local run) and the caller picks a free port.

    Example:
        >>> p = TaskPlacement("worker", 1, rank=3, world_size=4, local_rank=1, local_world_size=2,
        ...                   node_rank=1, num_nodes=2, master_addr="w0", master_port=2222,
        ...                   bind_addr="w1")
        >>> p.task_name, p.is_chief, p.describe_rank(2)
        ('worker:1', False, 'worker:1 (rank 2)')
    """

    task_type: str
    task_id: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    bind_addr: str
    sync_task_names: tuple[str, ...] = ()  # node_rank -> "chief:0"; empty means "worker:<node>"
    cluster_digest: str | None = None  # hash of the sync jobs' addresses, when a spec is known

    @property
    def task_name(self) -> str:
        """``"worker:1"``: how errors and logs name this task."""
        return f"{self.task_type}:{self.task_id}"

    @property
    def is_chief(self) -> bool:
        """True for global rank 0, the process that saves and prints."""
        return self.rank == 0

    @property
    def in_sync_group(self) -> bool:
        """False for ``ps`` and ``evaluator`` tasks, which join no collective."""
        return self.rank >= 0

    def describe_rank(self, rank: int) -> str:
        """Name the task that runs global ``rank``, e.g. ``"worker:1 (rank 3)"``."""
        if not 0 <= rank < self.world_size:
            return f"rank {rank}"
        node = rank // self.local_world_size
        names = self.sync_task_names
        return f"{names[node] if node < len(names) else f'worker:{node}'} (rank {rank})"

    def fingerprint(self) -> dict[str, Any]:
        """The fields every process of the job must agree on (JSON-serialisable)."""
        fields = asdict(self)
        return {name: fields[name] for name in FINGERPRINT_FIELDS}


def compare_fingerprints(mine: dict[str, Any], theirs: dict[str, Any], other_task: str) -> None:
    """Raise ClusterSpecMismatchError for the first field where two fingerprints differ."""
    extra = sorted((set(mine) | set(theirs)) - set(FINGERPRINT_FIELDS))
    for field in (*FINGERPRINT_FIELDS, *extra):
        if mine.get(field) != theirs.get(field):
            raise ClusterSpecMismatchError(field, mine.get(field), theirs.get(field), other_task)


def own_address_for(master_addr: str) -> str:
    """The local IP the kernel would use to reach ``master_addr``; ``"127.0.0.1"`` if none.

    Connecting a UDP socket only selects a route; no packet is sent.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(master_addr.strip("[]"), 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except (OSError, IndexError, UnicodeError):
        return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP) resolves to a loopback address."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None)
    except (OSError, UnicodeError):
        return host.strip("[]") in ("localhost", "127.0.0.1", "::1")
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def resolve_address(host: str) -> str | None:
    """The first IP ``host`` resolves to, or None when it does not resolve."""
    try:
        return str(socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]).split("%")[0]
    except (OSError, IndexError, UnicodeError):
        return None


def host_address() -> str | None:
    """The non-loopback IP this host's name resolves to (a pod's IP in Kubernetes), else None."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for info in infos:
        address = info[4][0].split("%")[0]
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def check_local_layout(local_world_size: Any, local_rank: Any) -> None:
    """Reject a local layout that cannot be right (before any process is started)."""
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
        raise ClusterSpecError(
            "local_world_size",
            local_world_size,
            "must be an integer >= 1",
            hint="pass the number of processes this task runs, e.g. its GPU count",
        )
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not 0 <= local_rank < local_world_size:
        raise ClusterSpecError(
            "local_rank",
            local_rank,
            f"must be an integer in 0..{local_world_size - 1}",
            hint=f"local_world_size is {local_world_size}",
        )


def sync_task_names(spec: ClusterSpec) -> tuple[str, ...]:
    """The synchronous tasks in node order: ``chief`` first, then ``worker`` by index."""
    return tuple(f"{job}:{i}" for job in SYNC_JOBS if job in spec.jobs for i in spec.task_indices(job))


def cluster_digest(spec: ClusterSpec) -> str:
    """A short hash of the sync jobs' addresses; equal digests mean equal chief/worker lists."""
    sync = {job: spec.as_dict()[job] for job in SYNC_JOBS if job in spec.jobs}
    return hashlib.sha256(json.dumps(sync, sort_keys=True).encode()).hexdigest()[:16]


def placement_from_spec(
    spec: ClusterSpec,
    task_type: str | None,
    task_id: int | None,
    *,
    local_world_size: int = 1,
    local_rank: int = 0,
) -> TaskPlacement:
    """Derive a TaskPlacement from a TF-style cluster (see the module docstring for the layout).

    An empty spec means a local run: one node, ``master_port`` 0.
    """
    check_local_layout(local_world_size, local_rank)
    if not spec:
        return TaskPlacement(
            task_type or "worker",
            task_id or 0,
            local_rank,
            local_world_size,
            local_rank,
            local_world_size,
            0,
            1,
            "127.0.0.1",
            0,
            "127.0.0.1",
        )
    names = sync_task_names(spec)
    if not names:
        raise ClusterSpecError(
            "cluster",
            spec.as_dict(),
            "the cluster has no 'chief' or 'worker' task",
            hint='add e.g. "worker": ["host0:2222"]',
        )
    first_job, first_id = names[0].split(":")
    master_addr, master_port = split_address(
        spec.task_address(first_job, int(first_id)), f"cluster.{first_job}[{first_id}]"
    )
    if task_type is None or task_id is None:
        raise ClusterSpecError(
            "task",
            f"{task_type}:{task_id}",
            "this task's type and index are not set",
            hint="set the resolver's task_type and task_id",
        )
    name = f"{task_type}:{task_id}"
    if task_type in spec.jobs:
        bind_addr = split_address(spec.task_address(task_type, task_id), f"cluster.{task_type}[{task_id}]")[0]
    else:  # an evaluator outside the cluster, as TF allows
        bind_addr = own_address_for(master_addr)
    node = names.index(name) if name in names else -1
    rank = node * local_world_size + local_rank if node >= 0 else -1
    return TaskPlacement(
        task_type,
        task_id,
        rank,
        len(names) * local_world_size,
        local_rank,
        local_world_size,
        node,
        len(names),
        master_addr,
        master_port,
        bind_addr,
        names,
        cluster_digest(spec),
    )
