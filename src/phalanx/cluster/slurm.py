"""``SlurmClusterResolver``: the layout of an ``srun`` step, one process per Slurm task."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from phalanx.cluster.placement import TaskPlacement, cluster_digest, own_address_for
from phalanx.cluster.resolver import ClusterResolver, env_int
from phalanx.cluster.spec import ClusterSpec
from phalanx.errors import ClusterSpecError

_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_HOSTLIST_HINT = "expected a Slurm hostlist like 'node[01-04,7],gpu5'"


def _split_top_level(text: str, key: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ClusterSpecError(key, text, "unbalanced or nested '[' ']'", hint=_HOSTLIST_HINT)
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if depth or not all(parts):
        raise ClusterSpecError(key, text, "unbalanced brackets or an empty host name", hint=_HOSTLIST_HINT)
    return parts


def _expand_ranges(ranges: str, key: str, text: str) -> list[str]:
    out: list[str] = []
    for item in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match or (match[2] and int(match[2]) < int(match[1])):
            raise ClusterSpecError(key, text, f"bad range {item!r}", hint=_HOSTLIST_HINT)
        lo, hi = match[1], match[2] or match[1]
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]  # keeps node01's padding
    return out


def _expand_one(name: str, key: str, text: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", name)
    if not match:
        if "[" in name or "]" in name:
            raise ClusterSpecError(key, text, f"cannot read {name!r}", hint=_HOSTLIST_HINT)
        return [name]
    prefix, ranges, rest = match.groups()
    tails = _expand_one(rest, key, text) if rest else [""]
    return [prefix + n + tail for n in _expand_ranges(ranges, key, text) for tail in tails]


def expand_hostlist(hostlist: str, key: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a Slurm hostlist: ``"node[01-03,7],gpu5"`` -> ``node01 node02 node03 node7 gpu5``.

    Example:
        >>> expand_hostlist("node[01-03,7],gpu5")
        ['node01', 'node02', 'node03', 'node7', 'gpu5']
        >>> expand_hostlist("r[1-2]-n[1-2]")
        ['r1-n1', 'r1-n2', 'r2-n1', 'r2-n2']
    """
    return [host for part in _split_top_level(hostlist, key) for host in _expand_one(part, key, hostlist)]


def _tasks_per_node(text: str) -> list[int]:
    # SLURM_TASKS_PER_NODE compresses repeats: "2(x3),1" means 2, 2, 2, 1.
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ClusterSpecError("SLURM_TASKS_PER_NODE", text, "is malformed", hint="Slurm writes it like '2(x3),1'")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


class SlurmClusterResolver(ClusterResolver):
    """Reads and validates the Slurm step environment at construction.

    The task is ``worker:<SLURM_NODEID>``; :meth:`cluster_spec` has one ``worker`` per node. The
    rendezvous is the first node, on MASTER_PORT or ``15000 + SLURM_JOB_ID % 20000`` (so
    concurrent jobs on shared nodes pick different ports).

    Raises:
        ClusterSpecError: a variable is missing, malformed or out of range (named, with its value).

    Example:
        >>> env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
        ...        "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_JOB_ID": "123"}
        >>> r = SlurmClusterResolver(environ=env)
        >>> p = r.placement()
        >>> p.task_name, p.rank, p.local_world_size, p.master_addr, p.master_port
        ('worker:2', 5, 2, 'gpu01', 15123)
    """

    def __init__(self, *, environ: Mapping[str, str] | None = None, rpc_layer: str | None = None) -> None:
        env = os.environ if environ is None else environ
        self._ntasks = env_int(env, "SLURM_NTASKS", low=1)
        self._rank = env_int(env, "SLURM_PROCID", high=self._ntasks - 1, what=f"SLURM_NTASKS is {self._ntasks}")
        self._nnodes = env_int(env, "SLURM_NNODES", low=1)
        self._node_rank = env_int(env, "SLURM_NODEID", high=self._nnodes - 1, what=f"SLURM_NNODES is {self._nnodes}")
        self._nodes = self._read_nodes(env)
        self._local_world_size = self._read_local_world_size(env)
        self._local_rank = env_int(
            env,
            "SLURM_LOCALID",
            high=self._local_world_size - 1,
            what=f"this node runs {self._local_world_size} tasks",
        )
        if env.get("MASTER_PORT", "").strip():
            self._port = env_int(env, "MASTER_PORT", low=1, high=65535)
        else:
            self._port = 15000 + env_int(env, "SLURM_JOB_ID", what="or set MASTER_PORT") % 20000
        super().__init__("worker", self._node_rank, rpc_layer)

    def _read_nodes(self, env: Mapping[str, str]) -> list[str]:
        var = next((v for v in _NODELIST_VARS if env.get(v, "").strip()), "SLURM_JOB_NODELIST")
        nodes = expand_hostlist(env.get(var, ""), var)
        if len(nodes) != self._nnodes:
            raise ClusterSpecError(
                var,
                env.get(var),
                f"lists {len(nodes)} nodes but SLURM_NNODES is {self._nnodes}",
                hint="run inside one srun step, whose variables agree",
            )
        return nodes

    def _read_local_world_size(self, env: Mapping[str, str]) -> int:
        if env.get("SLURM_TASKS_PER_NODE", "").strip():
            counts = _tasks_per_node(env["SLURM_TASKS_PER_NODE"])
            if len(counts) == self._nnodes:
                return counts[self._node_rank]
        return env_int(env, "SLURM_NTASKS_PER_NODE", -(-self._ntasks // self._nnodes), low=1)

    def cluster_spec(self) -> ClusterSpec:
        """``{"worker": ["node:port", ...]}``, one task per node."""
        return ClusterSpec({"worker": [f"{node}:{self._port}" for node in self._nodes]})

    def placement(self, local_world_size: int = 1, local_rank: int = 0) -> TaskPlacement:
        """The layout from the environment; Slurm fixes it, so the arguments are ignored."""
        del local_world_size, local_rank
        master = self._nodes[0]
        return TaskPlacement(
            "worker",
            self._node_rank,
            self._rank,
            self._ntasks,
            self._local_rank,
            self._local_world_size,
            self._node_rank,
            self._nnodes,
            master,
            self._port,
            own_address_for(master),
            cluster_digest=cluster_digest(self.cluster_spec()),
        )
