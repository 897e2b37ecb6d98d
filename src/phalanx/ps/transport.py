"""How frames move between tasks: gRPC, or an in-process fake for tests.

gRPC is TensorFlow's own parameter-server transport. phalanx uses it without generated code: a
*generic* handler registers a fixed list of method names per service, each a bidirectional
stream of raw ``bytes`` chunks (identity serializers); :mod:`phalanx.ps.wire` does the framing
and the authentication. A method that is not registered is answered ``UNIMPLEMENTED`` by gRPC
itself, so a peer can call nothing but a service's own operations.

Refusing cheaply. A frame travels in messages of at most ``wire.MAX_MESSAGE_BYTES`` (1 MiB and
1 KiB: a frame that fits, else chunks of 1 MiB), so gRPC is told to refuse any larger message
(``grpc.max_receive_message_length``) from its length prefix, and a model of any size still fits.
A request must deliver its first ``HEAD_BYTES`` (enough for a signed head) within
``HEAD_TIMEOUT`` seconds or it is cancelled, and the service verifies the head before it reads
the rest (:class:`phalanx.ps.wire.Verifier` admits a bounded number of unverified requests at
once). The server runs at most ``max_concurrent_rpcs`` calls at once (gRPC's
``maximum_concurrent_rpcs``; more are answered ``RESOURCE_EXHAUSTED``, which callers retry).

TLS is used when ``PHALANX_TLS_CERT`` / ``PHALANX_TLS_KEY`` (and, for mutual TLS,
``PHALANX_TLS_CA``) are set: :mod:`phalanx.ps.tls`.

Servers listen on the task's own address from the cluster spec, never on every interface
(``PHALANX_BIND_ADDRESS`` overrides the host; ``0.0.0.0`` or ``::`` there is logged as a warning).

The interfaces are small so that a test can swap in :class:`InProcessTransport`:

* ``Service.handle(method, chunks, peer) -> reply chunks`` (raises :class:`ServiceError`);
* ``Transport.serve(address, service) -> server`` (``server.stop(grace)``) and
  ``Transport.connect(address) -> Channel``;
* ``Channel.call(method, chunks, timeout) -> list of reply chunks`` and
  ``Channel.start(...) -> PendingCall``, raising :class:`TransportError` whose ``code`` says what
  happened.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from phalanx.cluster.validation import split_address
from phalanx.errors import FieldsPickled
from phalanx.ps.wire import MAX_MESSAGE_BYTES

log = logging.getLogger("phalanx.ps")

BIND_ENV = "PHALANX_BIND_ADDRESS"
TRANSIENT = frozenset({"unavailable", "deadline", "exhausted"})
HEAD_BYTES = 512
HEAD_TIMEOUT = 10.0
_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted task is reachable again within ~0.1-1 s instead of gRPC's default backoff (up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


class ServiceError(FieldsPickled, Exception):
    """Raised by a service's handler: the call is answered with this status and detail."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")


class TransportError(FieldsPickled, Exception):
    """A call failed. ``code``: unavailable, deadline, exhausted, cancelled, unauthenticated,
    unimplemented, invalid, not_found or internal."""

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

    def handle(self, method: str, chunks: Iterable[bytes], peer: str) -> Iterable[bytes]: ...


class PendingCall(Protocol):
    def result(self, timeout: float | None = None) -> list[bytes]:
        """The reply's chunks; ``TimeoutError`` if it is not there within ``timeout`` (the call goes on)."""

    def cancel(self) -> None: ...


class Channel(Protocol):
    def call(self, method: str, chunks: Iterable[bytes], timeout: float | None) -> list[bytes]: ...

    def start(self, method: str, chunks: Iterable[bytes], timeout: float | None) -> PendingCall: ...

    def close(self) -> None: ...


def bind_host(address: str) -> tuple[str, int]:
    """The host and port a task listens on: its own, or ``PHALANX_BIND_ADDRESS``'s host."""
    host, port = split_address(address, "task address")
    override = os.environ.get(BIND_ENV, "").strip()
    if override:
        if override in ("0.0.0.0", "::", "[::]", "*"):
            log.warning(
                "phalanx: listening on every interface (%s=%s); anyone who can reach port %d can "
                "connect (requests still need the cluster secret)",
                BIND_ENV,
                override,
                port,
            )
        host = override.strip("[]")
    return host, port


# --------------------------------------------------------------------------------------------- gRPC
def _grpc() -> Any:
    try:
        import grpc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "ParameterServerStrategy needs gRPC: pip install -e '.[ps]' (grpcio, cloudpickle, cryptography)"
        ) from e
    return grpc


_STATUS_TO_CODE: dict[str, str] = {
    "UNAVAILABLE": "unavailable",
    "DEADLINE_EXCEEDED": "deadline",
    "CANCELLED": "cancelled",
    "UNAUTHENTICATED": "unauthenticated",
    "PERMISSION_DENIED": "unauthenticated",
    "UNIMPLEMENTED": "unimplemented",
    "INVALID_ARGUMENT": "invalid",
    "NOT_FOUND": "not_found",
    "FAILED_PRECONDITION": "invalid",
    "RESOURCE_EXHAUSTED": "exhausted",
}
_CODE_TO_STATUS = {
    "unauthenticated": "UNAUTHENTICATED",
    "unimplemented": "UNIMPLEMENTED",
    "invalid": "INVALID_ARGUMENT",
    "not_found": "NOT_FOUND",
    "unavailable": "UNAVAILABLE",
    "internal": "INTERNAL",
    "exhausted": "RESOURCE_EXHAUSTED",
}


def _from_rpc_error(e: Any) -> TransportError:
    code = e.code() if callable(getattr(e, "code", None)) else None
    name = getattr(code, "name", "INTERNAL")
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return TransportError(_STATUS_TO_CODE.get(name, "internal"), details or name)


class _GrpcPending:
    """A call whose reply is read by a daemon thread (gRPC delivers a stream only to a reader)."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self._drain, name="phalanx-rpc-reply", daemon=True).start()

    def _drain(self) -> None:
        grpc = _grpc()
        try:
            self._future.set_result(list(self._call))
        except grpc.RpcError as e:
            self._future.set_exception(_from_rpc_error(e))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._future.set_exception(e)

    def result(self, timeout: float | None = None) -> list[bytes]:
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError from None

    def cancel(self) -> None:
        self._call.cancel()


class GrpcChannel:
    """A client channel to one task (methods are ``/<service>/<method>``, streams of chunks)."""

    def __init__(self, address: str, service: str, tls: Any = None) -> None:
        grpc = _grpc()
        self.address = address
        self._service = service
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=_GRPC_OPTIONS)
        else:
            self._channel = grpc.secure_channel(address, tls.channel_credentials(grpc), options=_GRPC_OPTIONS)
        self._stubs: dict[str, Any] = {}

    def _stub(self, method: str) -> Any:
        stub = self._stubs.get(method)
        if stub is None:
            stub = self._stubs[method] = self._channel.stream_stream(f"/{self._service}/{method}")
        return stub

    def call(self, method: str, chunks: Iterable[bytes], timeout: float | None) -> list[bytes]:
        grpc = _grpc()
        try:
            return list(self._stub(method)(iter(chunks), timeout=timeout))
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None

    def start(self, method: str, chunks: Iterable[bytes], timeout: float | None) -> _GrpcPending:
        return _GrpcPending(self._stub(method)(iter(chunks), timeout=timeout))

    def close(self) -> None:
        self._channel.close()


class _HeadWatch:
    """Cancels calls whose first ``HEAD_BYTES`` did not arrive in time (one thread per server, not per call)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._pending: dict[int, tuple[float, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="phalanx-head-watch", daemon=True)
        self._thread.start()

    def watch(self, key: int, context: Any) -> None:
        with self._lock:
            self._pending[key] = (time.monotonic() + self.timeout, context)

    def done(self, key: int) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def _loop(self) -> None:
        while not self._stop.wait(min(0.5, self.timeout / 4)):
            now = time.monotonic()
            with self._lock:
                late = [k for k, (deadline, _) in self._pending.items() if deadline < now]
                contexts = [self._pending.pop(k)[1] for k in late]
            for context in contexts:
                context.cancel()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


class _Incoming:
    """A request's chunks; the call is cancelled unless its first ``HEAD_BYTES`` arrive within the watch's timeout."""

    def __init__(self, requests: Iterator[bytes], context: Any, watch: _HeadWatch) -> None:
        self._requests, self._received, self._watch = requests, 0, watch
        self._watched = True
        watch.watch(id(self), context)

    def __iter__(self) -> _Incoming:
        return self

    def __next__(self) -> bytes:
        try:
            chunk = next(self._requests)
        except BaseException:
            self.done()
            raise
        self._received += len(chunk)
        if self._received >= HEAD_BYTES:
            self.done()
        return chunk

    def done(self) -> None:
        if self._watched:
            self._watched = False
            self._watch.done(id(self))


class GrpcServer:
    """A gRPC server for one service, bound to ``address`` (the task's own).

    Args:
        max_workers: threads that run calls.
        max_concurrent_rpcs: calls accepted at once (running or queued); more are refused.
        tls: a :class:`phalanx.ps.tls.TlsConfig`, or None for plain text.
    """

    def __init__(
        self,
        address: str,
        service: Service,
        max_workers: int = 8,
        max_concurrent_rpcs: int = 64,
        tls: Any = None,
        head_timeout: float = HEAD_TIMEOUT,
    ) -> None:
        grpc = _grpc()
        self._watch = _HeadWatch(head_timeout)

        def make(method: str) -> Any:
            def handler(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
                incoming = _Incoming(requests, context, self._watch)
                try:
                    reply = service.handle(method, incoming, context.peer())
                except ServiceError as e:
                    incoming.done()
                    context.abort(getattr(grpc.StatusCode, _CODE_TO_STATUS.get(e.code, "INTERNAL")), e.detail)
                incoming.done()
                yield from reply

            return grpc.stream_stream_rpc_method_handler(handler)

        generic = grpc.method_handlers_generic_handler(service.NAME, {m: make(m) for m in service.METHODS})
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="phalanx-rpc")
        self._server = grpc.server(
            self._pool,
            handlers=[generic],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            options=[*_GRPC_OPTIONS, ("grpc.so_reuseport", 0)],
        )
        host, port = bind_host(address)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is None:
                bound = self._server.add_insecure_port(target)
            else:
                bound = self._server.add_secure_port(target, tls.server_credentials(grpc))
        except RuntimeError as e:
            bound, cause = 0, str(e)
        else:
            cause = "gRPC could not bind it"
        if not bound:
            from phalanx.errors import ClusterSpecError

            self._watch.stop()
            raise ClusterSpecError(
                "address",
                address,
                f"cannot listen on {target} ({cause})",
                hint=f"check that the port is free and that the host is this machine's, or set "
                f"{BIND_ENV} to the local address to listen on",
            )
        self.address = address
        self._server.start()

    def stop(self, grace: float = 1.0) -> None:
        self._server.stop(grace).wait(grace + 1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._watch.stop()


_FROM_ENV: Any = object()


class GrpcTransport:
    """The production transport.

    Args:
        tls: a :class:`phalanx.ps.tls.TlsConfig`; by default the ``PHALANX_TLS_*`` environment
            variables say (plain text when none is set).
    """

    def __init__(self, tls: Any = _FROM_ENV) -> None:
        if tls is _FROM_ENV:
            from phalanx.ps.tls import TlsConfig

            tls = TlsConfig.from_env()
        self.tls = tls

    def serve(self, address: str, service: Service) -> GrpcServer:
        return GrpcServer(address, service, tls=self.tls)

    def connect(self, address: str, service: str) -> GrpcChannel:
        return GrpcChannel(address, service, tls=self.tls)


# --------------------------------------------------------------------------------------- in-process
class _InProcessPending:
    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> list[bytes]:
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

    def call(self, method: str, chunks: Iterable[bytes], timeout: float | None) -> list[bytes]:
        return self._hub._call(self.address, self._service, method, chunks)

    def start(self, method: str, chunks: Iterable[bytes], timeout: float | None) -> _InProcessPending:
        return _InProcessPending(self._hub._executor().submit(self.call, method, chunks, timeout))

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

    def _call(self, address: str, service_name: str, method: str, chunks: Iterable[bytes]) -> list[bytes]:
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
            return list(service.handle(method, chunks, "inproc"))
        except ServiceError as e:
            raise TransportError(e.code, e.detail) from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
