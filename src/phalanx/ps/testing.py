"""``InProcessCluster``: parameter servers, workers and the chief in one process, for tests.

Everything but the transport is the production code: the same services, coordinator and
strategy, talking through :class:`~phalanx.ps.transport.InProcessTransport` instead of gRPC, so
faults (a dead server, transient errors) can be injected deterministically and quickly.

Example:
    >>> import torch
    >>> with InProcessCluster(num_ps=2, num_workers=1) as cluster:
    ...     with cluster.strategy.scope():
    ...         layer = torch.nn.Linear(3, 1)
    ...     [v.device for v in cluster.strategy.extended.variables]
    ['/job:ps/replica:0/task:0/device:CPU:0', '/job:ps/replica:0/task:1/device:CPU:0']
"""

from __future__ import annotations

from typing import Any

from phalanx.cluster import SimpleClusterResolver
from phalanx.ps.transport import InProcessTransport
from phalanx.ps.variable_server import ParameterServerService
from phalanx.ps.worker import WorkerService

_SECRET = "in-process-test-secret-0123456789"


class InProcessCluster:
    """A chief ``strategy`` over ``num_ps`` servers and ``num_workers`` workers, all in this process.

    ``coordinator()`` creates the ClusterCoordinator; ``kill_ps``, ``kill_worker``,
    ``restart_worker`` and ``transport.inject(address, code, count)`` inject faults.
    """

    def __init__(
        self, num_ps: int = 2, num_workers: int = 2, *, variable_partitioner: Any = None, rpc_timeout: float = 2.0
    ) -> None:
        from phalanx.ps.parameter_server_strategy import ParameterServerStrategy

        self.transport = InProcessTransport()
        self.spec = {
            "chief": ["127.0.0.1:1000"],
            "ps": [f"127.0.0.1:{1100 + i}" for i in range(num_ps)],
            "worker": [f"127.0.0.1:{1200 + i}" for i in range(num_workers)],
        }
        self._timeout = rpc_timeout
        self.ps = [self._start_ps(i) for i in range(num_ps)]
        self.workers = [self._start_worker(i) for i in range(num_workers)]
        self.strategy = ParameterServerStrategy(
            SimpleClusterResolver(self.spec, task_type="chief", task_id=0),
            variable_partitioner,
            rpc_timeout=rpc_timeout,
            cluster_secret=_SECRET,
            transport=self.transport,
        )

    def _start_ps(self, i: int) -> ParameterServerService:
        service = ParameterServerService(i, _SECRET.encode())
        self.transport.serve(self.spec["ps"][i], service)
        return service

    def _start_worker(self, i: int) -> WorkerService:
        from phalanx.ps.parameter_server_strategy import ParameterServerStrategy

        strategy = ParameterServerStrategy(
            SimpleClusterResolver(self.spec, task_type="worker", task_id=i),
            rpc_timeout=self._timeout,
            cluster_secret=_SECRET,
            transport=self.transport,
            serve_and_exit=False,
        )
        service = WorkerService(i, len(self.spec["worker"]), strategy, strategy.extended.shard_io, _SECRET.encode())
        self.transport.serve(self.spec["worker"][i], service)
        return service

    def coordinator(self) -> Any:
        from phalanx.ps.cluster_coordinator import ClusterCoordinator

        return ClusterCoordinator(self.strategy)

    def kill_ps(self, i: int) -> None:
        self.transport.kill(self.spec["ps"][i])

    def kill_worker(self, i: int) -> None:
        self.transport.kill(self.spec["worker"][i])

    def restart_worker(self, i: int) -> WorkerService:
        self.workers[i] = self._start_worker(i)
        return self.workers[i]

    def close(self) -> None:
        self.strategy.close()
        self.transport.close()

    def __enter__(self) -> InProcessCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
