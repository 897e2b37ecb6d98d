"""``ClusterSpec``: which jobs a cluster has and where each task listens.

It mirrors ``tf.train.ClusterSpec``: only the structure is checked here (job names are strings,
tasks are a list or a sparse ``{index: address}`` dict of strings). Whether the addresses and job
names make sense for a strategy is :func:`phalanx.cluster.validation.validate_cluster`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.errors import ClusterSpecError

# A job's tasks as a user writes them: dense list, or TF's sparse form {index: address}.
JobTasks = list[str] | dict[int, str]

_SHAPE_HINT = 'write it as {"worker": ["host:port", ...]} or sparse as {"worker": {0: "host:port"}}'


def _coerce_index(key: str, index: Any) -> int:
    # JSON object keys are always strings, so TF_CONFIG's sparse form arrives as {"0": ...}.
    if isinstance(index, str) and index.isdigit():
        return int(index)
    if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
        return index
    raise ClusterSpecError(key, index, "sparse task indices must be non-negative integers", hint=_SHAPE_HINT)


def normalize_job(job: Any, tasks: Any) -> dict[int, str]:
    """Return one job's tasks as ``{index: address}`` sorted by index.

    Raises:
        ClusterSpecError: the job name is not a string, or the tasks are not a list or dict of
            non-empty strings.
    """
    if not isinstance(job, str) or not job:
        raise ClusterSpecError("cluster", job, "job names must be non-empty strings", hint=_SHAPE_HINT)
    key = f"cluster.{job}"
    if isinstance(tasks, (list, tuple)):
        pairs = list(enumerate(tasks))
    elif isinstance(tasks, Mapping):
        pairs = [(_coerce_index(key, i), address) for i, address in tasks.items()]
        if len({i for i, _ in pairs}) != len(pairs):
            raise ClusterSpecError(key, tasks, "the same task index is given twice", hint=_SHAPE_HINT)
    else:
        raise ClusterSpecError(key, tasks, "a job's tasks must be a list or a dict", hint=_SHAPE_HINT)
    for i, address in pairs:
        if not isinstance(address, str) or not address:
            raise ClusterSpecError(
                f"{key}[{i}]", address, "a task address must be a 'host:port' string", hint=_SHAPE_HINT
            )
    return dict(sorted(pairs))


class ClusterSpec:
    """The jobs of a cluster and the network address of each task, as in TensorFlow.

    Args:
        cluster: ``{job: [address, ...]}``, ``{job: {index: address}}`` or another ClusterSpec.

    Example:
        >>> spec = ClusterSpec({"chief": ["c:2222"], "worker": {0: "w0:2222", 2: "w2:2222"}})
        >>> spec.jobs
        ['chief', 'worker']
        >>> spec.task_indices("worker"), spec.task_address("worker", 2)
        ([0, 2], 'w2:2222')
        >>> spec.job_tasks("worker")
        ['w0:2222', None, 'w2:2222']
    """

    def __init__(self, cluster: Mapping[str, Any] | ClusterSpec) -> None:
        if isinstance(cluster, ClusterSpec):
            jobs = cluster._jobs
        elif isinstance(cluster, Mapping):
            jobs = {job: normalize_job(job, tasks) for job, tasks in cluster.items()}
        else:
            raise ClusterSpecError("cluster", cluster, "must be a dict of job name to tasks", hint=_SHAPE_HINT)
        # Copied so that later changes to the caller's dict cannot change this spec.
        self._jobs: dict[str, dict[int, str]] = {job: dict(jobs[job]) for job in sorted(jobs)}

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return list(self._jobs)

    def _tasks(self, job: str) -> dict[int, str]:
        try:
            return self._jobs[job]
        except (KeyError, TypeError):
            raise ClusterSpecError(
                "job", job, "no such job in the cluster", hint=f"jobs in this cluster: {self.jobs}"
            ) from None

    def num_tasks(self, job: str) -> int:
        """Number of tasks in ``job``; raises ClusterSpecError for an unknown job."""
        return len(self._tasks(job))

    def task_indices(self, job: str) -> list[int]:
        """The sorted task indices of ``job`` (not always ``0..n-1`` with the sparse form)."""
        return list(self._tasks(job))

    def task_address(self, job: str, index: int) -> str:
        """The ``host:port`` of task ``index`` of ``job``."""
        tasks = self._tasks(job)
        if isinstance(index, bool) or index not in tasks:
            raise ClusterSpecError(
                f"{job}.index",
                index,
                f"no such task in job {job!r}",
                hint=f"valid indices: {list(tasks)}",
            )
        return tasks[index]

    def job_tasks(self, job: str) -> list[str | None]:
        """Addresses of ``job`` by index; missing indices of a sparse job are ``None``."""
        tasks = self._tasks(job)
        size = max(tasks) + 1 if tasks else 0
        return [tasks.get(i) for i in range(size)]

    def as_dict(self) -> dict[str, JobTasks]:
        """A new dict: a list for jobs indexed ``0..n-1``, a sparse dict otherwise (as TF does)."""
        out: dict[str, JobTasks] = {}
        for job, tasks in self._jobs.items():
            dense = list(tasks) == list(range(len(tasks)))
            out[job] = list(tasks.values()) if dense else dict(tasks)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._jobs == other._jobs

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value type, like TF's

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __repr__(self) -> str:
        items = ", ".join(f"{job!r}: {tasks!r}" for job, tasks in self.as_dict().items())
        return f"ClusterSpec({{{items}}})"
