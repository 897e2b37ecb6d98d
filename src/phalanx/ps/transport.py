"""How frames move between tasks: gRPC, or an in-process fake for tests.

gRPC is TensorFlow's own parameter-server transport. phalanx uses it without generated code: a
*generic* handler registers a fixed list of method names per service and passes the request
bytes through untouched (identity serializers); :mod:`phalanx.ps.wire` does the framing and the
authentication. A method that is not registered is answered ``UNIMPLEMENTED`` by gRPC itself, so
a peer can call nothing but a service's own operations.

Servers listen on the task's own address from the cluster spec, never on every interface
(``PHALANX_BIND_ADDRESS`` overrides the host; ``0.0.0.0`` or ``::`` there is logged as a warning).

The interfaces are small so that a test can swap in :class:`InProcessTransport`:

* ``Service.handle(method, body, peer) -> bytes`` (raises :class:`ServiceError`);
* ``Transport.serve(address, service) -> server`` (``server.stop(grace)``) and
  ``Transport.connect(address) -> Channel``;
* ``Channel.call(method, body, timeout) -> bytes`` and ``Channel.start(...) -> PendingCall``,
  raising :class:`TransportError` whose ``code`` says what happened.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Any, Protocol

from phalanx.cluster.validation import split_address

log = logging.getLogger("phalanx.ps")

BIND_ENV = "PHALANX_BIND_ADDRESS"
TRANSIENT = frozenset({"unavailable", "deadline"})
_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # A restarted task is reachable again within ~0.1-1 s instead of gRPC's default backoff (up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


class ServiceError(Exception):
    """Raised by a service's handler: the call is answered with this status and detail."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")


class TransportError(Exception):
    """A call failed. ``code``: unavailable, deadline, cancelled, unauthenticated, unimplemented,
    invalid, not_found or internal."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")

    @property
    def transient(self) -> bool:
        return self.code in TRANSIENT


class Service(Protocol):
    NAME: str
    METHODS: tuple[str, ...]

    def handle(self, method: str, body: bytes, peer: str) -> bytes: ...


class PendingCall(Protocol):
    def result(self, timeout: float | None = None) -> bytes:
        """The reply; ``TimeoutError`` if it is not there within ``timeout`` (the call goes on)."""

    def cancel(self) -> None: ...


class Channel(Protocol):
    def call(self, method: str, body: bytes, timeout: float | None) -> bytes: ...

    def start(self, method: str, body: bytes, timeout: float | None) -> PendingCall: ...

    def close(self) -> None: ...


def bind_host(address: str) -> tuple[str, int]:
    """The host and port a task listens on: its own, or ``PHALANX_BIND_ADDRESS``'s host."""
    host, port = split_address(address, "task address")
    override = os.environ.get(BIND_ENV, "").strip()
    if override:
        if override in ("0.0.0.0", "::", "[::]", "*"):
            log.warning("phalanx: listening on every interface (%s=%s); anyone who can reach port %d can "
                        "connect (requests still need the cluster secret)", BIND_ENV, override, port)
        host = override.strip("[]")
    return host, port


# --------------------------------------------------------------------------------------------- gRPC
def _grpc() -> Any:
    try:
        import grpc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("ParameterServerStrategy needs gRPC: pip install 'phalanx[ps]' (grpcio, cloudpickle)") from e
    return grpc


_STATUS_TO_CODE: dict[str, str] = {
    "UNAVAILABLE": "unavailable", "DEADLINE_EXCEEDED": "deadline", "CANCELLED": "cancelled",
    "UNAUTHENTICATED": "unauthenticated", "PERMISSION_DENIED": "unauthenticated", "UNIMPLEMENTED": "unimplemented",
    "INVALID_ARGUMENT": "invalid", "NOT_FOUND": "not_found", "FAILED_PRECONDITION": "invalid",
}
_CODE_TO_STATUS = {"unauthenticated": "UNAUTHENTICATED", "unimplemented": "UNIMPLEMENTED",
                   "invalid": "INVALID_ARGUMENT", "not_found": "NOT_FOUND", "unavailable": "UNAVAILABLE",
                   "internal": "INTERNAL"}


def _from_rpc_error(e: Any) -> TransportError:
    code = e.code() if callable(getattr(e, "code", None)) else None
    name = getattr(code, "name", "INTERNAL")
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return TransportError(_STATUS_TO_CODE.get(name, "internal"), details or name)


class _GrpcPending:
    def __init__(self, future: Any) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> bytes:
        import grpc

        try:
            return self._future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError from None
        except grpc.FutureCancelledError:
            raise TransportError("cancelled", "call cancelled") from None
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None

    def cancel(self) -> None:
        self._future.cancel()


class GrpcChannel:
    """A client channel to one task (``grpc.insecure_channel``; methods are ``/<service>/<method>``)."""

    def __init__(self, address: str, service: str) -> None:
        grpc = _grpc()
        self.address = address
        self._service = service
        self._channel = grpc.insecure_channel(address, options=_GRPC_OPTIONS)
        self._stubs: dict[str, Any] = {}

    def _stub(self, method: str) -> Any:
        stub = self._stubs.get(method)
        if stub is None:
            stub = self._stubs[method] = self._channel.unary_unary(f"/{self._service}/{method}")
        return stub

    def call(self, method: str, body: bytes, timeout: float | None) -> bytes:
        import grpc

        try:
            return self._stub(method)(body, timeout=timeout)
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None

    def start(self, method: str, body: bytes, timeout: float | None) -> _GrpcPending:
        return _GrpcPending(self._stub(method).future(body, timeout=timeout))

    def close(self) -> None:
        self._channel.close()


class GrpcServer:
    """A gRPC server for one service, bound to ``address`` (the task's own)."""

    def __init__(self, address: str, service: Service, max_workers: int = 8) -> None:
        grpc = _grpc()

        def make(method: str) -> Any:
            def handler(request: bytes, context: Any) -> bytes:
                try:
                    return service.handle(method, request, context.peer())
                except ServiceError as e:
                    context.abort(getattr(grpc.StatusCode, _CODE_TO_STATUS.get(e.code, "INTERNAL")), e.detail)

            return grpc.unary_unary_rpc_method_handler(handler)

        generic = grpc.method_handlers_generic_handler(service.NAME, {m: make(m) for m in service.METHODS})
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="phalanx-rpc")
        self._server = grpc.server(self._pool, handlers=[generic],
                                   options=[*_GRPC_OPTIONS, ("grpc.so_reuseport", 0)])
        host, port = bind_host(address)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = self._server.add_insecure_port(target)
        except RuntimeError as e:
            bound, cause = 0, str(e)
        else:
            cause = "gRPC could not bind it"
        if not bound:
            from phalanx.errors import ClusterSpecError

            raise ClusterSpecError("address", address, f"cannot listen on {target} ({cause})",
                                   hint=f"check that the port is free and that the host is this machine's, or set "
                                        f"{BIND_ENV} to the local address to listen on")
        self.address = address
        self._server.start()

    def stop(self, grace: float = 1.0) -> None:
        self._server.stop(grace).wait(grace + 1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrpcTransport:
    """The production transport."""

    def serve(self, address: str, service: Service) -> GrpcServer:
        return GrpcServer(address, service)

    def connect(self, address: str, service: str) -> GrpcChannel:
        return GrpcChannel(address, service)


# --------------------------------------------------------------------------------------- in-process
class _InProcessPending:
    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> bytes:
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError from None
        except concurrent.futures.CancelledError:
            raise TransportError("cancelled", "call cancelled") from None

    def cancel(self) -> None:
        self._future.cancel()


class InProcessChannel:
    def __init__(self, hub: InProcessTransport, address: str, service: str) -> None:
        self._hub, self.address, self._service = hub, address, service

    def call(self, method: str, body: bytes, timeout: float | None) -> bytes:
        return self._hub._call(self.address, self._service, method, body)

    def start(self, method: str, body: bytes, timeout: float | None) -> _InProcessPending:
        return _InProcessPending(self._hub._executor().submit(self.call, method, body, timeout))

    def close(self) -> None:
        return None


class InProcessTransport:
    """Every task in one process, for tests: services registered by address, with fault injection.

    ``kill(address)`` makes a task unreachable; ``inject(address, code, count)`` makes its next
    ``count`` calls fail with ``code`` (e.g. ``"unavailable"``) before they reach it.
    """

    def __init__(self) -> None:
        self._services: dict[str, Service] = {}
        self._faults: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="phalanx-inproc")
            return self._pool

    def serve(self, address: str, service: Service) -> Any:
        hub = self

        class _Server:
            def stop(self, grace: float = 1.0) -> None:
                hub.kill(address)

        with self._lock:
            self._services[address] = service
        return _Server()

    def connect(self, address: str, service: str) -> InProcessChannel:
        return InProcessChannel(self, address, service)

    def kill(self, address: str) -> None:
        with self._lock:
            self._services.pop(address, None)

    def inject(self, address: str, code: str, count: int = 1) -> None:
        with self._lock:
            self._faults.setdefault(address, []).extend([code] * count)

    def _call(self, address: str, service_name: str, method: str, body: bytes) -> bytes:
        with self._lock:
            faults = self._faults.get(address)
            fault = faults.pop(0) if faults else None
            service = self._services.get(address)
        if fault is not None:
            raise TransportError(fault, f"injected {fault}")
        if service is None:
            raise TransportError("unavailable", f"nothing serves {address}")
        if service_name != service.NAME or method not in service.METHODS:
            raise TransportError("unimplemented", "Method not found!")
        try:
            return service.handle(method, body, "inproc")
        except ServiceError as e:
            raise TransportError(e.code, e.detail) from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
