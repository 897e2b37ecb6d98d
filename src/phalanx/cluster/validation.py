"""Local checks of a cluster description, done before any process opens a socket.

Every check is pure Python on the given values (no DNS, no connections), so a bad TF_CONFIG is
reported in microseconds with the key and value that are wrong, instead of as a rendezvous
timeout minutes later.

Example:
    >>> validate_cluster({"worker": ["a:1", "b:1"]}, "worker", 1).num_tasks("worker")
    2
    >>> try:
    ...     validate_cluster({"worker": ["a:1"], "ps": ["p:1"]}, "worker", 0, allow_ps=False)
    ... except ValueError as e:
    ...     print(e.key, e.value)
    cluster.ps ['p:1']
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from typing import Any

from phalanx.cluster.spec import ClusterSpec, normalize_job
from phalanx.errors import ClusterSpecError

ALLOWED_JOBS = ("chief", "worker", "ps", "evaluator")
SYNC_JOBS = ("chief", "worker")  # the tasks that take part in synchronous collectives
_SINGLE_TASK_JOBS = ("chief", "evaluator")

_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]")
_ADDRESS_HINT = "write addresses as 'host:port', e.g. 'worker0.example.com:2222' or '[::1]:2222'"

Jobs = dict[str, dict[int, str]]


def split_address(address: str, key: str = "address") -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into ``(host, port)``; v6 hosts lose brackets.

    Raises:
        ClusterSpecError: naming ``key`` when the host or the port is malformed.
    """
    host, sep, port = str(address).rpartition(":")
    if not sep or not host:
        raise ClusterSpecError(key, address, "expected 'host:port'", hint=_ADDRESS_HINT)
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ClusterSpecError(key, address, f"port {port!r} is not a number in 1..65535", hint=_ADDRESS_HINT)
    if _IPV6.fullmatch(host):
        return host[1:-1], int(port)
    if not _HOST.fullmatch(host):
        # Catches "grpc://h:1", "h:1:2", spaces, and IPv6 without brackets.
        raise ClusterSpecError(key, address, f"host {host!r} is not a hostname or IP", hint=_ADDRESS_HINT)
    return host, int(port)


def _normalize(cluster: Any) -> Jobs:
    if isinstance(cluster, ClusterSpec):
        cluster = cluster.as_dict()
    if not isinstance(cluster, Mapping):
        raise ClusterSpecError(
            "cluster",
            cluster,
            "must be an object of job name to task addresses",
            hint='e.g. {"worker": ["host0:2222", "host1:2222"]}',
        )
    return {job: normalize_job(job, tasks) for job, tasks in cluster.items()}


def _check_jobs(jobs: Jobs) -> None:
    for job, tasks in jobs.items():
        if job not in ALLOWED_JOBS:
            raise ClusterSpecError(
                f"cluster.{job}",
                list(tasks.values()),
                f"unknown job name {job!r}",
                hint=f"allowed job names: {', '.join(ALLOWED_JOBS)}",
            )
    for job in _SINGLE_TASK_JOBS:
        if len(jobs.get(job, {})) > 1:
            raise ClusterSpecError(
                f"cluster.{job}",
                list(jobs[job].values()),
                f"there must be at most one {job!r} task",
                hint=f"make the extra {job} tasks 'worker' tasks",
            )
    if "worker" in jobs and not jobs["worker"]:
        raise ClusterSpecError(
            "cluster.worker",
            [],
            "the worker list is empty",
            hint="list at least one 'host:port', or drop the 'worker' key",
        )
    if not any(jobs.get(job) for job in SYNC_JOBS):
        raise ClusterSpecError(
            "cluster",
            {j: list(t.values()) for j, t in jobs.items()},
            "the cluster has no 'chief' or 'worker' task",
            hint='add e.g. "worker": ["host0:2222"]',
        )


def _family(host: str) -> int | None:
    """4 or 6 for an IP literal, None for a hostname (resolving it would be network I/O)."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).version
    except ValueError:
        return None


def _check_addresses(jobs: Jobs) -> None:
    seen: dict[tuple[str, int], str] = {}
    families: dict[int, str] = {}  # IP version -> the first task written with it
    for job, tasks in jobs.items():
        for index, address in tasks.items():
            key = f"cluster.{job}[{index}]"
            host, port = split_address(address, key)
            family = _family(host)
            if family is not None:
                families.setdefault(family, key)
                other = families.get(10 - family)  # 4 <-> 6
                if other is not None:
                    # An IPv4 task cannot reach an IPv6 listener: the job would only time out.
                    raise ClusterSpecError(
                        key,
                        address,
                        f"an IPv{family} address in a cluster whose {other} has an IPv{10 - family} "
                        "address; tasks of one job must use one address family",
                        hint="write every task's address as IPv4, or every one as IPv6 (or use hostnames)",
                    )
            # Compared as written: resolving names would be network I/O, and tasks on one
            # host that spell it differently still collide at bind time anyway.
            other = seen.setdefault((host.lower(), port), key)
            if other != key:
                raise ClusterSpecError(
                    key,
                    address,
                    f"the same host:port is also used by {other}",
                    hint="give every task its own port",
                )


def _check_ps(jobs: Jobs, require_ps: bool | None, allow_ps: bool) -> None:
    if not allow_ps and "ps" in jobs:
        raise ClusterSpecError(
            "cluster.ps",
            list(jobs["ps"].values()),
            "this strategy does not use parameter servers",
            hint="remove 'ps' from the cluster, or use ParameterServerStrategy",
        )
    if require_ps and not jobs.get("ps"):
        raise ClusterSpecError(
            "cluster.ps",
            list(jobs.get("ps", {}).values()) or None,
            "parameter-server training needs at least one 'ps' task",
            hint='add e.g. "ps": ["ps0:2222"]',
        )
    if require_ps and not jobs.get("worker"):
        raise ClusterSpecError(
            "cluster.worker",
            None,
            "parameter-server training needs workers",
            hint='add e.g. "worker": ["worker0:2222"]',
        )


def _check_task(jobs: Jobs, task_type: Any, task_id: Any) -> None:
    if task_type not in ALLOWED_JOBS:
        raise ClusterSpecError(
            "task.type", task_type, "not a known task type", hint=f"use one of: {', '.join(ALLOWED_JOBS)}"
        )
    if task_type not in jobs and task_type != "evaluator":  # TF lets the evaluator stay outside
        raise ClusterSpecError(
            "task.type",
            task_type,
            "this job is not in the cluster",
            hint=f"jobs in the cluster: {', '.join(jobs)}",
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        raise ClusterSpecError("task.index", task_id, "must be an integer", hint='e.g. "index": 0')
    if task_id < 0:
        raise ClusterSpecError("task.index", task_id, "must not be negative", hint="indices start at 0")
    indices = list(jobs.get(task_type, {}))
    if task_type in jobs and task_id not in indices:
        raise ClusterSpecError(
            "task.index",
            task_id,
            f"job {task_type!r} has no such task (indices: {indices})",
            hint=f"use an index listed for {task_type!r} in the cluster",
        )


def validate_cluster(
    cluster: Mapping[str, Any] | ClusterSpec,
    task_type: Any,
    task_id: Any,
    *,
    require_ps: bool | None = None,
    allow_ps: bool = True,
) -> ClusterSpec:
    """Check a cluster and this task's place in it; return the cluster as a ClusterSpec.

    Args:
        cluster: ``{job: [address, ...]}`` (or the sparse dict form, or a ClusterSpec).
        task_type: this task's job, e.g. ``"worker"``.
        task_id: this task's index in its job.
        require_ps: ``True`` for parameter-server training: needs ``ps`` and ``worker`` tasks.
            ``None`` or ``False`` add no requirement.
        allow_ps: ``False`` rejects a ``ps`` job (MultiWorkerMirroredStrategy passes this).

    Raises:
        ClusterSpecError: the first problem found, naming its key and value.
    """
    jobs = _normalize(cluster)
    _check_jobs(jobs)
    _check_addresses(jobs)
    _check_ps(jobs, require_ps, allow_ps)
    _check_task(jobs, task_type, task_id)
    return ClusterSpec(jobs)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _task_index(value: Any) -> Any:
    # TF itself calls int() on task.index, so '"index": "1"' works there and must work here.
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        return int(value)
    return value


def parse_tf_config(
    text: str, *, require_task: bool = True
) -> tuple[dict[str, Any], str | None, int | None, str | None]:
    """Parse a TF_CONFIG string into ``(cluster, task_type, task_id, rpc_layer)``.

    Only the JSON shape is checked here; pass the result to :func:`validate_cluster`.

    Args:
        text: the TF_CONFIG value.
        require_task: if False a missing ``task`` gives ``(cluster, None, None, rpc_layer)``.

    Raises:
        ClusterSpecError: with key ``TF_CONFIG`` for bad JSON, a non-object, or a missing
            ``cluster`` / ``task``; with ``cluster`` / ``task`` / ``rpc_layer`` for wrong types.
    """
    hint = 'e.g. {"cluster": {"worker": ["h0:2222", "h1:2222"]}, "task": {"type": "worker", "index": 0}}'
    try:
        config = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise ClusterSpecError("TF_CONFIG", _short(str(text)), f"is not valid JSON ({e})", hint=hint) from None
    if not isinstance(config, dict):
        raise ClusterSpecError("TF_CONFIG", _short(text), "must be a JSON object", hint=hint)
    for part in ("cluster", "task") if require_task else ("cluster",):
        if part not in config:
            raise ClusterSpecError("TF_CONFIG", _short(text), f"has no {part!r} key", hint=hint)
    cluster, task = config["cluster"], config.get("task", {})
    if not isinstance(cluster, dict):
        raise ClusterSpecError("cluster", cluster, "must be an object of job name to addresses", hint=hint)
    if not isinstance(task, dict):
        raise ClusterSpecError("task", task, 'must be an object like {"type": "worker", "index": 0}', hint=hint)
    rpc_layer = config.get("rpc_layer")
    if rpc_layer is not None and not isinstance(rpc_layer, str):
        raise ClusterSpecError("rpc_layer", rpc_layer, "must be a string", hint='e.g. "grpc"')
    return cluster, task.get("type"), _task_index(task.get("index")), rpc_layer
