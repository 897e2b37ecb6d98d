"""``phalanx.Server``: TF's ``tf.distribute.Server`` for the tasks of a parameter-server cluster.

A ``ps`` or ``worker`` task of ParameterServerStrategy only serves: it holds variables (ps) or runs
the functions the coordinator schedules (worker). TF programs start such a task with
``tf.distribute.Server(...)`` and ``server.join()``, or start servers in threads of one process
(the parameter-server tutorial's in-process cluster); both work here unchanged. (Constructing
``ParameterServerStrategy()`` in a ps or worker task serves too, then exits the process.)

Example::

    resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        server = phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                task_index=resolver.task_id, protocol="grpc", start=True)
        server.join()

Differences from TF: ``config`` is accepted and ignored; ``protocol`` must be ``"grpc"`` (or None);
the server of a task serves phalanx's operations, not arbitrary TF graphs; the cluster's shared
secret comes from ``PHALANX_CLUSTER_SECRET`` (or ``cluster_secret=``).
"""

from __future__ import annotations

import threading
from typing import Any

from phalanx._compat.python import register_before_thread_pools_exit
from phalanx.cluster import ClusterSpec, SimpleClusterResolver
from phalanx.errors import ClusterSpecError


class Server:
    """Serves one ``ps`` or ``worker`` task of a cluster.

    Args:
        server_or_cluster_def: a ClusterSpec or its dict (``{"ps": [...], "worker": [...], "chief": [...]}``).
        job_name: ``"ps"`` or ``"worker"``.
        task_index: the task's index in its job.
        protocol: ``"grpc"`` (the only transport).
        config: ignored (TF's ConfigProto).
        start: start serving now (in a background thread).
        cluster_secret: the shared secret (default ``PHALANX_CLUSTER_SECRET``).

    Raises:
        ClusterSpecError: a job other than ps/worker, an unknown task, or another protocol.
    """

    def __init__(
        self,
        server_or_cluster_def: Any,
        job_name: str | None = None,
        task_index: int | None = None,
        protocol: str | None = None,
        config: Any = None,
        start: bool = True,
        *,
        cluster_secret: str | bytes | None = None,
    ) -> None:
        from phalanx.ps.parameter_server_strategy import ParameterServerStrategy

        if protocol not in (None, "grpc"):
            raise ClusterSpecError("protocol", protocol, "phalanx servers speak gRPC only", hint='use protocol="grpc"')
        if job_name not in ("ps", "worker"):
            raise ClusterSpecError(
                "job_name",
                job_name,
                "a phalanx Server serves a 'ps' or 'worker' task",
                hint="the chief runs the program itself: create ParameterServerStrategy there",
            )
        spec = server_or_cluster_def
        spec = spec.as_dict() if isinstance(spec, ClusterSpec) else dict(spec)
        self._job, self._index = job_name, int(task_index or 0)
        self._strategy = ParameterServerStrategy(
            SimpleClusterResolver(spec, task_type=job_name, task_id=self._index),
            cluster_secret=cluster_secret,
            serve_and_exit=False,
        )
        tasks = spec[job_name]
        address = tasks[self._index]  # a list, or a dict {index: address}
        self._target = f"grpc://{address}"
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @property
    def target(self) -> str:
        """``grpc://host:port`` of this task."""
        return self._target

    @property
    def server_def(self) -> dict[str, Any]:
        return {"job_name": self._job, "task_index": self._index, "protocol": "grpc"}

    def start(self) -> None:
        """Starts serving in a background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._strategy.serve, name=f"phalanx-server-{self._job}:{self._index}", daemon=True
            )
            self._thread.start()
            # At exit, stop serving before Python shuts down the thread pools gRPC answers from
            # (concurrent.futures' exit hook); later requests would fail noisily in gRPC's threads.
            register_before_thread_pools_exit(self.stop)

    def stop(self, timeout: float = 5.0) -> None:
        """Stops serving (what the coordinator's shutdown request does) and waits for it."""
        # friend: the service's shutdown callback is what the coordinator's shutdown request runs
        service = getattr(self._strategy.extended, "_service", None)  # friend: no public handle yet
        if service is not None and getattr(service, "_on_shutdown", None) is not None:  # friend
            service._on_shutdown()  # friend: as the coordinator's shutdown request does
        if self._thread is not None:
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Blocks until the coordinator shuts the cluster down (or ``timeout`` seconds pass)."""
        self.start()
        assert self._thread is not None
        self._thread.join(timeout)

    @staticmethod
    def create_local_server(config: Any = None, start: bool = True) -> Server:
        """TF's single-task local server; phalanx has no use for one."""
        raise ClusterSpecError(
            "cluster",
            None,
            "a local in-process TF server has no phalanx equivalent",
            hint="use OneDeviceStrategy for one process, or Server(cluster, 'ps'|'worker', i)",
        )
