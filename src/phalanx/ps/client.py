"""One peer task as its callers see it: signed calls, bounded waits, transient retries, typed errors.

Each :class:`RemoteTask` signs its calls as one sender (:class:`phalanx.ps.wire.Signer`) and
accepts only replies bound to them. A call that fails with a *transient* transport error
(unavailable, deadline, exhausted) is sent again, under a new number (a server takes each number
once), up to ``attempts`` times in all, 0.1 s apart, as TF's coordinator ignores a few transient parameter-server
errors (``TF_COORDINATOR_IGNORE_TRANSIENT_PS_FAILURES``, 3 reports). A deadline is not retried: the
call already waited the whole RPC timeout. What still fails becomes
:class:`~phalanx.ps.errors.ParameterServerUnavailableError` (or ``TaskUnavailableError`` for a
worker), naming the task.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.ps import wire
from phalanx.ps.errors import (
    AuthenticationError,
    ParameterServerUnavailableError,
    ProtocolError,
    TaskUnavailableError,
    VariableError,
)
from phalanx.ps.transport import TransportError

log = logging.getLogger("phalanx.ps")

TRANSIENT_ATTEMPTS = 3
RETRY_DELAY = 0.1
PS_SERVICE = "phalanx.ParameterServer"
WORKER_SERVICE = "phalanx.Worker"


@dataclass(frozen=True)
class Reply:
    """A reply's chunks, with the call they answer (so that :meth:`RemoteTask.decode` can check the binding)."""

    chunks: list[bytes]
    call: wire.Frame


class _Pending:
    def __init__(self, pending: Any, frame: wire.Frame) -> None:
        self._pending, self._frame = pending, frame

    def result(self, timeout: float | None = None) -> Reply:
        return Reply(self._pending.result(timeout), self._frame)

    def cancel(self) -> None:
        self._pending.cancel()


class RemoteTask:
    """Calls to one task (``job``/``index`` at ``address``) over ``transport``.

    Args:
        rpc_timeout: deadline of each call, in seconds (None: no deadline; for closures, which a
            heartbeat watches instead).
        sender: the calling task's name (signed into every call; servers treat calls from
            ``chief:*`` as the chief's sign of life).
    """

    def __init__(
        self, job: str, index: int, address: str, transport: Any, secret: bytes, rpc_timeout: float, sender: str = ""
    ) -> None:
        self.job, self.index, self.address = job, index, address
        self.name = f"{job}:{index}"
        self._transport = transport
        self._signer = wire.Signer(secret, sender)
        self._verifier = wire.Verifier(secret, max_unverified=1 << 16)
        self.rpc_timeout = rpc_timeout
        self._service = PS_SERVICE if job == "ps" else WORKER_SERVICE
        self._channel = transport.connect(address, self._service)
        # Whether the task has answered a call: one that never did may still be starting, one that
        # did and is unavailable now is gone (the chief's shutdown asks only the first again).
        self.answered = False

    def reconnect(self) -> None:
        """A fresh channel (after the task died: no stale connection state is kept)."""
        old, self._channel = self._channel, self._transport.connect(self.address, self._service)
        old.close()

    def close(self) -> None:
        self._channel.close()

    def unavailable(self, cause: str) -> TaskUnavailableError:
        cls = ParameterServerUnavailableError if self.job == "ps" else TaskUnavailableError
        return cls(self.index, self.address, cause)

    def translate(self, method: str, e: TransportError) -> Exception:
        """The typed error for a failed call."""
        if e.transient or e.code == "cancelled":
            return self.unavailable(f"{method}: {e.code} ({e.detail})")
        if e.code == "unauthenticated":
            return AuthenticationError(
                f"{self.name} at {self.address} refused our {method!r} request: {e.detail}",
                hint="every task must have the same PHALANX_CLUSTER_SECRET",
            )
        if e.code == "not_found":
            if self.job == "ps":
                # A parameter server that no longer knows a variable has restarted and lost its state.
                return self.unavailable(
                    f"{method}: {e.detail} (the parameter server restarted and lost its variables?)"
                )
            return VariableError(f"{self.name}: {e.detail}")
        if e.code == "invalid":
            return VariableError(f"{self.name} refused {method!r}: {e.detail}")
        return ProtocolError(f"{self.name} failed {method!r}: {e.code} ({e.detail})")

    def encode(
        self,
        method: str,
        header: Mapping[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        blobs: Sequence[bytes] = (),
    ) -> wire.Frame:
        return self._signer.encode(method, header, tensors, blobs)

    def decode(self, method: str, reply: Reply) -> wire.Message:
        """The verified reply (it must answer ``reply.call``)."""
        try:
            message = self._verifier.decode(method, reply.chunks, reply_to=reply.call.head)
            self.answered = True
            return message
        except AuthenticationError as e:
            raise AuthenticationError(
                f"{self.name} at {self.address}: its reply to {method!r} was refused: {e}",
                hint="every task must have the same PHALANX_CLUSTER_SECRET",
            ) from None

    def call(
        self,
        method: str,
        header: Mapping[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        blobs: Sequence[bytes] = (),
        *,
        timeout: float | None = -1.0,
        attempts: int = TRANSIENT_ATTEMPTS,
    ) -> wire.Message:
        """Sends one request and returns the verified reply."""
        body = self.encode(method, header, tensors, blobs)
        return self.call_encoded(method, body, timeout=timeout, attempts=attempts)

    def call_encoded(
        self, method: str, frame: wire.Frame, *, timeout: float | None = -1.0, attempts: int = TRANSIENT_ATTEMPTS
    ) -> wire.Message:
        timeout = self.rpc_timeout if timeout == -1.0 else timeout
        for attempt in range(1, attempts + 1):
            try:
                return self.decode(method, Reply(self._channel.call(method, frame.chunks(), timeout), frame))
            except TransportError as e:
                if not e.transient or e.code == "deadline" or attempt == attempts:
                    raise self.translate(method, e) from None
            time.sleep(RETRY_DELAY)
            frame = frame.renewed()
        raise AssertionError("unreachable")

    def start(self, method: str, frame: wire.Frame, timeout: float | None = -1.0) -> _Pending:
        """Sends ``frame`` without waiting; ``result()`` gives a :class:`Reply` for :meth:`decode`."""
        timeout = self.rpc_timeout if timeout == -1.0 else timeout
        return _Pending(self._channel.start(method, frame.chunks(), timeout), frame)


def call_all(calls: Sequence[tuple[RemoteTask, str, Mapping[str, Any], Sequence[torch.Tensor]]]) -> list[wire.Message]:
    """Sends requests to several tasks at once and returns their replies in order.

    A request that fails transiently is retried on its own (see :class:`RemoteTask`); the first
    error that remains is raised after every request has ended.
    """
    if len(calls) == 1:
        task, method, header, tensors = calls[0]
        return [task.call(method, header, tensors)]
    bodies = [task.encode(method, header, tensors) for task, method, header, tensors in calls]
    pending = [task.start(method, body) for (task, method, _, _), body in zip(calls, bodies)]
    out: list[wire.Message | None] = []
    first_error: Exception | None = None
    for (task, method, _, _), body, p in zip(calls, bodies, pending):
        try:
            try:
                out.append(task.decode(method, p.result(timeout=None)))
            except TransportError as e:
                if not e.transient or e.code == "deadline":
                    raise task.translate(method, e) from None
                out.append(task.call_encoded(method, body.renewed(), attempts=TRANSIENT_ATTEMPTS - 1))
        except Exception as e:  # noqa: BLE001 - re-raised below, after every call has ended
            out.append(None)
            first_error = first_error or e
    if first_error is not None:
        raise first_error
    return out  # type: ignore[return-value]


class Keepalive:
    """The chief's sign of life: pings every task every ``interval`` seconds, signed as ``chief:<index>``.

    Parameter servers and workers exit when they hear nothing authenticated from the chief for
    ``PHALANX_ORPHAN_TIMEOUT`` seconds (:mod:`phalanx.ps.service`); the coordinator's own calls
    may be far apart (before it exists, while the chief evaluates), so these pings keep them alive.

    Args:
        tasks: ``(job, index, address)`` of every task to keep alive.
        interval: seconds between rounds of pings.
    """

    def __init__(
        self,
        tasks: Sequence[tuple[str, int, str]],
        transport: Any,
        secret: bytes,
        interval: float,
        sender: str = "chief:0",
    ) -> None:
        timeout = max(0.5, min(5.0, interval))
        self._tasks = [
            RemoteTask(job, index, address, transport, secret, timeout, sender=sender) for job, index, address in tasks
        ]
        self._interval = interval
        self._stop = threading.Event()
        self._refused: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="phalanx-keepalive", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            for task in self._tasks:
                if self._stop.is_set():
                    return
                try:
                    task.call("ping", attempts=1)
                except AuthenticationError as e:
                    if task.name not in self._refused:
                        self._refused.add(task.name)
                        log.error("phalanx chief: %s refuses our requests: %s", task.name, e)
                except Exception as e:  # noqa: BLE001 - down or busy: the coordinator reports dead servers
                    log.debug("phalanx chief: keepalive ping to %s failed: %s", task.name, e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)
        for task in self._tasks:
            task.close()
