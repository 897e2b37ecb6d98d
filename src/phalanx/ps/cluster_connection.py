"""The chief's connections to its cluster: the parameter servers, the workers, and their lifetime.

:class:`ClusterConnection` is the collaborator a
:class:`~phalanx.ps.parameter_server_strategy.ParameterServerExtended` holds for its role as the
coordinator's client (``extended.cluster``): it waits for every parameter server at start, connects
to the workers, keeps every task from counting itself orphaned (a keepalive), and tells every task
to exit when the cluster shuts down.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from phalanx import config
from phalanx.comm.rendezvous import WaitNotice
from phalanx.errors import RendezvousTimeoutError
from phalanx.ps.client import RemoteTask
from phalanx.ps.errors import TaskUnavailableError

__all__ = ["ClusterConnection"]

log = logging.getLogger("phalanx.ps")


class ClusterConnection:
    """One task's connections to the cluster's parameter servers and workers (see the module docstring).

    Args:
        role: this task's job (only the chief stops the cluster).
        task_name: this task, as ``job:index`` (the sender of every call).
        cluster: the validated cluster.
        transport: the gRPC transport (or the in-process fake).
        secret: the cluster's shared secret.
        rpc_timeout: seconds before a call to a task counts as failed.
    """

    def __init__(
        self, role: str, task_name: str, cluster: Any, transport: Any, secret: bytes, rpc_timeout: float
    ) -> None:
        self._role, self._task_name = role, task_name
        self._cluster, self._transport, self._secret = cluster, transport, secret
        self._rpc_timeout = rpc_timeout
        self.ps_tasks = [
            RemoteTask("ps", i, cluster.task_address("ps", i), transport, secret, rpc_timeout, sender=task_name)
            for i in cluster.task_indices("ps")
        ]
        # Each parameter server's incarnation when the chief connected (a restarted one has another).
        self.ps_incarnations: list[str | None] = [None] * len(self.ps_tasks)
        self._workers: list[RemoteTask] = []
        self.stopped = False  # the cluster was told to stop, or is left running for another chief
        self._keepalive: Any = None

    def wait_for_parameter_servers(self, timeout: float, notice_after: float | None = None) -> None:
        """Pings every parameter server until each answered, within ``timeout``; names the ones still
        silent on stderr after ``notice_after`` seconds, once (rather than two minutes of silence)."""
        deadline = time.monotonic() + timeout
        notice = WaitNotice(notice_after)
        pending = dict(enumerate(self.ps_tasks))
        while pending:
            for i, task in list(pending.items()):
                try:
                    reply = task.call("ping", timeout=min(2.0, self._rpc_timeout), attempts=1)
                except TaskUnavailableError:
                    continue
                self.ps_incarnations[i] = reply.header.get("incarnation")
                del pending[i]
            if pending:
                if time.monotonic() > deadline:
                    raise RendezvousTimeoutError([t.name for t in pending.values()], timeout)
                notice.poll(lambda: [f"{t.name} at {t.address}" for t in pending.values()], deadline)
                time.sleep(0.1)

    def workers(self) -> list[RemoteTask]:
        """Connections to every worker (made once)."""
        if not self._workers:
            self._workers = [
                RemoteTask(
                    "worker",
                    i,
                    self._cluster.task_address("worker", i),
                    self._transport,
                    self._secret,
                    self._rpc_timeout,
                    sender=self._task_name,
                )
                for i in self._cluster.task_indices("worker")
            ]
        return self._workers

    def stop(self, timeout: float = 5.0) -> None:
        """Tells every worker and parameter server to exit (best effort, bounded by ``timeout``)."""
        if self.stopped or self._role != "chief":
            return
        self.stopped = True
        tasks = self.workers() + self.ps_tasks
        per_call = max(0.1, min(2.0, timeout))
        deadline = time.monotonic() + timeout
        threads = [threading.Thread(target=_tell_to_stop, args=(t, per_call, deadline), daemon=True) for t in tasks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for task in tasks:
            task.close()

    def start_keepalive(self) -> None:
        """The chief pings every task, so none of them counts itself orphaned (see :mod:`phalanx.ps.service`)."""
        from phalanx.ps.client import Keepalive

        orphan = config.settings().orphan_timeout
        tasks = [
            (job, i, self._cluster.task_address(job, i))
            for job in ("ps", "worker")
            for i in self._cluster.task_indices(job)
        ]
        self._keepalive = Keepalive(
            tasks, self._transport, self._secret, max(0.2, min(10.0, orphan / 4)), sender=self._task_name
        )

    def close(self) -> None:
        """Stops the keepalive (the cluster itself is stopped by :meth:`stop`)."""
        keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None:
            keepalive.stop()


def _tell_to_stop(task: Any, per_call: float, deadline: float) -> None:
    """Sends ``task`` the shutdown request (best effort, bounded by ``deadline``).

    A task that never answered the chief may still be starting (a worker warms torch.optim up
    before it serves, 1.5 s or more on a busy host): it is asked again until the deadline, so it
    does not serve on until its orphan timeout after the chief has ended the cluster. One that
    answered before and is unavailable now is gone (a killed parameter server): asked once.
    """
    while True:
        try:
            task.call("shutdown", timeout=min(per_call, max(0.1, deadline - time.monotonic())), attempts=1)
            return
        except TaskUnavailableError as e:
            if task.answered or time.monotonic() + 0.1 >= deadline:
                log.debug("phalanx: shutdown request not delivered: %s", e)
                return
            time.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - best effort: the task may be gone already
            log.debug("phalanx: shutdown request not delivered: %s", e)
            return
