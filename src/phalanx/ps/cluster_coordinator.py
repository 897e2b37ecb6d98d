"""``ClusterCoordinator``: schedules functions on workers, asynchronously (TF's ``ClusterCoordinator``).

The chief runs the user's program. ``schedule(fn, args, kwargs)`` pickles the call at once (its
arguments are captured then), queues it and returns a :class:`RemoteValue`. One dispatcher thread
per worker takes the next function from the queue and runs it on its worker; a parameter server
monitor pings the servers. Semantics (TF's, from ``cluster_coordinator.py``):

* **At-least-once.** A function whose worker dies or stalls (no heartbeat answer within the RPC
  timeout) is put back at the head of the queue and runs on another worker; it may have been
  partly executed. A worker that comes back (restarted on the same address) is reconnected and
  gets new work, its per-worker datasets built again.
* **Errors.** The first exception raised by a scheduled function is raised by the next
  ``schedule``, ``join`` or ``done`` and then cleared; functions still queued when it failed are
  cancelled (their ``fetch()`` raises :class:`~phalanx.ps.errors.CancelledError`). When ``join``
  returns or raises, no scheduled function is still executing.
* **Parameter servers.** A server that dies, stalls or restarts makes ``schedule``, ``join``,
  ``done`` and ``fetch`` raise :class:`~phalanx.ps.errors.ParameterServerUnavailableError` naming
  it, within the RPC timeout plus a heartbeat (under 1 s): its variables are gone. The error
  stays: restart the server and the coordinator, and restore from a checkpoint.
* **Bounded.** Every wait has a timeout; ``shutdown()`` returns within its timeout (10 s).

Worker states (:class:`WorkerState`) go ``CONNECTING -> IDLE <-> RUNNING``; a lost worker goes
back to ``CONNECTING`` (its function put back); ``shutdown`` makes every state ``STOPPED``.
"""

from __future__ import annotations

import atexit
import enum
import itertools
import logging
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx import nest
from phalanx._compat.python import register_before_thread_pools_exit
from phalanx.errors import NotCallableError
from phalanx.ps import pickling
from phalanx.ps.client import RemoteTask
from phalanx.ps.closures import (
    PerWorkerDataset,
    RemoteValue,
    _Closure,
    _ClosureQueue,
    _Resource,
    _value_of,
)
from phalanx.ps.errors import (
    AuthenticationError,
    CoordinatorClosedError,
    ParameterServerUnavailableError,
    ProtocolError,
    RemoteError,
    TaskUnavailableError,
    WorkerUnavailableError,
)
from phalanx.ps.transport import TransportError

if TYPE_CHECKING:
    from phalanx.ps.parameter_server_strategy import ParameterServerStrategy

log = logging.getLogger("phalanx.ps")

# Types that are never replaced by a reference: most of what a function's pickle holds.
_PLAIN = frozenset(
    {
        str,
        int,
        float,
        bool,
        bytes,
        tuple,
        list,
        dict,
        set,
        frozenset,
        type(None),
        type,
        types.FunctionType,
        types.CodeType,
        types.CellType,
        types.ModuleType,
        types.BuiltinFunctionType,
    }
)
_IDLE_PING = 5.0  # seconds between pings to an idle worker (keeps its orphan timer fresh, notices deaths)


class WorkerState(enum.Enum):
    """Lifecycle of one worker as its dispatcher sees it."""

    CONNECTING = "connecting"  # not reached yet, or lost: pinged until it answers
    IDLE = "idle"  # reachable, waiting for a function
    RUNNING = "running"  # running a function (watched by heartbeats)
    STOPPED = "stopped"  # the coordinator shut down (terminal)


class _WorkerLost(Exception):
    pass


class _Stopped(Exception):
    pass


class _WorkerDispatcher:
    """Runs queued functions on one worker, one at a time, and watches it while it runs them."""

    def __init__(self, coordinator: ClusterCoordinator, task: RemoteTask, heartbeat: float) -> None:
        self._coordinator = coordinator
        self.task = task
        self.state = WorkerState.CONNECTING
        self.incarnation: str | None = None
        self.pid: int | None = None
        self.completed = 0
        self.failures = 0
        self._heartbeat = heartbeat
        self._built: set[str] = set()
        self._last_contact = 0.0
        self._auth_warned = False
        self._thread = threading.Thread(target=self._loop, name=f"phalanx-dispatch-{task.name}", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(max(0.0, timeout))

    @property
    def connected(self) -> bool:
        return self.state in (WorkerState.IDLE, WorkerState.RUNNING)

    def _loop(self) -> None:
        coordinator, queue, stop = self._coordinator, self._coordinator._queue, self._coordinator._stop
        backoff = 0.05
        while not stop.is_set():
            if self.state is WorkerState.CONNECTING:
                if not self._connect():
                    stop.wait(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                backoff = 0.05
            closure = queue.get(timeout=0.2)
            if closure is None:
                if time.monotonic() - self._last_contact > _IDLE_PING and not self._ping_ok():
                    self._lost("no answer to an idle ping")
                continue
            self.state = WorkerState.RUNNING
            try:
                reply = self._execute(closure)
            except _WorkerLost as e:
                self.failures += 1
                queue.put_back(closure)
                self._lost(f"{e}; {closure.id} is put back and will run again (at-least-once)")
                continue
            except _Stopped:
                queue.put_back(closure)
                break
            except Exception as e:  # noqa: BLE001 - a protocol or authentication failure: the function fails
                self.state = WorkerState.IDLE
                coordinator._closure_failed(closure, e)
                continue
            self.state = WorkerState.IDLE
            self.completed += 1
            coordinator._complete(closure, reply, self)
        self.state = WorkerState.STOPPED

    def _lost(self, why: str) -> None:
        log.warning("phalanx coordinator: lost %s (%s)", self.task.name, why)
        self.state = WorkerState.CONNECTING
        self.task.reconnect()

    def _ping(self, timeout: float) -> Any:
        reply = self.task.call("ping", timeout=timeout, attempts=1)
        self._last_contact = time.monotonic()
        return reply

    def _ping_ok(self) -> bool:
        try:
            reply = self._ping(self.task.rpc_timeout)
        except Exception:  # noqa: BLE001 - any failure means the worker is not usable now
            return False
        return reply.header.get("incarnation") == self.incarnation

    def _connect(self) -> bool:
        try:
            reply = self._ping(min(self.task.rpc_timeout, 5.0))
        except AuthenticationError as e:
            if not self._auth_warned:
                self._auth_warned = True
                log.error("phalanx coordinator: %s refuses our requests (%s); it gets no work", self.task.name, e)
            return False
        except Exception:  # noqa: BLE001 - not up (yet, or again)
            return False
        incarnation = reply.header.get("incarnation")
        if incarnation != self.incarnation:
            if self.incarnation is not None:
                log.warning(
                    "phalanx coordinator: %s is back (pid %s); its per-worker datasets are rebuilt",
                    self.task.name,
                    reply.header.get("pid"),
                )
            self._built.clear()
            self.incarnation, self.pid = incarnation, reply.header.get("pid")
        self.state = WorkerState.IDLE
        self._coordinator._worker_seen()
        return True

    def _execute(self, closure: _Closure) -> Any:
        missing: list[_Resource] = []
        for r in closure.resources:
            if r.id not in self._built and r not in missing:
                missing.append(r)
        if missing:
            blobs = [r.blob for r in missing if isinstance(r, PerWorkerDataset)]
            metas, b = [], 0
            for r in missing:
                metas.append(r.meta(b))
                b += isinstance(r, PerWorkerDataset)
            reply = self._call("resources", {"resources": metas}, blobs)
            if reply.header.get("status") != "ok":
                return self._check(reply)
            self._built.update(r.id for r in missing)
        return self._check(self._call("run", {"closure": closure.id}, [closure.payload]))

    def _check(self, reply: Any) -> Any:
        if reply.header.get("kind") == "missing_resource":  # it restarted between our calls
            raise _WorkerLost("it lost its per-worker resources (restarted?)")
        return reply

    def _call(self, method: str, header: dict, blobs: list[bytes]) -> Any:
        stop = self._coordinator._stop
        pending = self.task.start(method, self.task.encode(method, header, (), blobs), timeout=None)
        while True:
            try:
                raw = pending.result(timeout=self._heartbeat)
            except TimeoutError:
                if stop.is_set():
                    pending.cancel()
                    raise _Stopped from None
                if not self._ping_ok():  # dead, stalled or restarted: the call will not complete
                    pending.cancel()
                    raise _WorkerLost("no heartbeat answer while it was running a function") from None
                continue
            except TransportError as e:
                if e.code in ("unauthenticated", "unimplemented", "invalid"):
                    raise self.task.translate(method, e) from None
                if stop.is_set():
                    raise _Stopped from None
                raise _WorkerLost(f"{method} failed: {e.code} ({e.detail})") from None
            self._last_contact = time.monotonic()
            return self.task.decode(method, raw)


class ClusterCoordinator:
    """Schedules functions to run on the workers of a :class:`~phalanx.ParameterServerStrategy`.

    One coordinator per strategy: ``ClusterCoordinator(strategy)`` returns the strategy's live one
    if it has one, as in TF. Create it on the chief.

    Example (``train.py``, run with ``phalanx run --ps 2 --workers 3 train.py``)::

        strategy = phalanx.ParameterServerStrategy()        # ps/worker tasks serve here, then exit
        coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = torch.nn.Linear(16, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def dataset_fn():
            return itertools.cycle(make_batches())
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        def step(iterator):
            x, y = next(iterator)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(); loss.backward(); optimizer.step()   # the update runs on the PS
            return loss

        losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(1000)]
        coordinator.join()                                    # model now holds the PS's values
        print(losses[-1].fetch())

    Raises:
        TypeError: ``strategy`` is not a ParameterServerStrategy on its chief.
    """

    def __new__(cls, strategy: ParameterServerStrategy) -> ClusterCoordinator:
        existing = getattr(getattr(strategy, "extended", None), "_coordinator", None)
        if isinstance(existing, cls) and not existing._closed:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        if getattr(self, "_initialized", False):
            return
        from phalanx.ps.parameter_server_strategy import ParameterServerExtended

        ext = getattr(strategy, "extended", None)
        if not isinstance(ext, ParameterServerExtended):
            raise TypeError(f"ClusterCoordinator needs a ParameterServerStrategy; received {type(strategy).__name__}")
        if ext.role != "chief":
            raise TypeError(f"ClusterCoordinator runs on the chief; this process is {ext.task_name}")
        self._initialized = True
        self._strategy = strategy
        self._ext = ext
        self._queue = _ClosureQueue()
        self._stop = threading.Event()
        self._closed = False
        self._fatal: BaseException | None = None
        self._numbers = itertools.count()
        self._last_worker_seen = time.monotonic()
        ext.coordinator = self
        self._workers = [_WorkerDispatcher(self, task, ext.heartbeat_interval) for task in ext.connect_workers()]
        self._monitor = threading.Thread(target=self._watch_parameter_servers, name="phalanx-ps-monitor", daemon=True)
        self._monitor.start()
        ref = weakref.ref(self)

        def at_exit() -> None:
            if ref() is not None:
                ref().shutdown()

        # Before Python's thread pools shut down, and before the servers of this process stop (an
        # in-process phalanx.Server registered earlier runs later): the cluster ends as shutdown()
        # ends it, instead of its servers vanishing under the dispatchers ("lost worker").
        if not register_before_thread_pools_exit(at_exit):
            atexit.register(at_exit)

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    @property
    def workers(self) -> list[_WorkerDispatcher]:
        """One dispatcher per worker (``state``, ``pid``, ``completed``, ``failures``), for monitoring."""
        return list(self._workers)

    # ------------------------------------------------------------------------------ public API
    def schedule(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on a free worker and returns its :class:`RemoteValue` at once.

        The call is pickled now (arguments are captured as they are now; a RemoteValue argument
        is waited for and passed as its value), and the chief's variables changed since they were
        last sent are sent to the parameter servers first.

        Raises:
            the first error of an earlier function (then cleared); ParameterServerUnavailableError;
            CoordinatorClosedError; NotCallableError; pickling errors for ``fn`` or its arguments.
        """
        if not callable(fn):
            raise NotCallableError(fn)
        if self._closed:
            raise CoordinatorClosedError(
                "schedule() after the coordinator shut down.", hint="create a new strategy and coordinator"
            )
        self._raise_if_fatal()
        self._queue.raise_if_error()
        if not isinstance(args, (tuple, list)):
            args = (args,)
        self._ext.push_variables()
        # A RemoteValue argument (the result of an earlier function) is passed as its value.
        args, kwargs = nest.map_structure(_value_of, (tuple(args), dict(kwargs or {})))
        resources: list[_Resource] = []
        payload = self._dumps((fn, args, kwargs), resources)
        closure = _Closure(self, next(self._numbers), fn, payload, resources)
        self._queue.put(closure)
        return closure.remote_value

    def join(self) -> None:
        """Waits until every scheduled function has finished; then the chief's variables hold the servers' values.

        Raises:
            the first error raised by a scheduled function (once; the functions still queued
            when it failed were cancelled); ParameterServerUnavailableError; WorkerUnavailableError (no worker
            for longer than the recovery timeout).
        """
        self._queue.wait(self._check_progress)
        self._ext.pull_variables()

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises as :meth:`join` does)."""
        self._raise_if_fatal()
        return self._queue.done()

    def fetch(self, val: Any) -> Any:
        """``val`` with every :class:`RemoteValue` in it replaced by its fetched value."""
        return nest.map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, val)

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """A dataset built on every worker by ``dataset_fn()`` (or ``dataset_fn(input_context)``).

        ``iter()`` of it gives a :class:`PerWorkerIterator` to pass to scheduled functions. Each
        worker builds its dataset before the first function that needs it, and again after it
        restarts (the iterator starts over there).
        """
        if not callable(dataset_fn):
            raise NotCallableError(dataset_fn, what="dataset_fn")
        return PerWorkerDataset(self, dataset_fn)

    def shutdown(self, timeout: float = 10.0, *, stop_cluster: bool = True) -> None:
        """Stops dispatching, cancels what is queued, and (by default) tells every server to exit.

        Returns within ``timeout`` seconds whatever state the cluster is in. Also run at exit.
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._queue.close()
        for w in self._workers:
            w.join(deadline - time.monotonic() - 0.5 * stop_cluster)
        self._monitor.join(max(0.0, min(1.0, deadline - time.monotonic())))
        if self._ext.coordinator is self:
            self._ext.coordinator = None
        if stop_cluster:
            self._ext.stop_cluster(max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------ internals
    def _dumps(self, obj: Any, resources: list[_Resource]) -> bytes:
        ext = self._ext

        def persistent_id(o: Any) -> Any:
            if type(o) in _PLAIN:  # most of what is pickled; keeps scheduling cheap
                return None
            if isinstance(o, _Resource):
                for r in o._requirements():  # friend: ps.closures is the coordinator's own
                    if r not in resources:
                        resources.append(r)
                return ("resource", o.id)
            if isinstance(o, ClusterCoordinator):
                return ("none",)
            return ext.persistent_id(o)

        return pickling.dumps(obj, persistent_id)

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _set_fatal(self, error: BaseException) -> None:
        with self._queue.cv:
            if self._fatal is not None:
                return
            self._fatal = error
            cancelled = self._queue.cancel_queued(error)
            self._queue.cv.notify_all()
        log.error("phalanx coordinator: %s (%d queued functions cancelled)", error, cancelled)

    def _worker_seen(self) -> None:
        self._last_worker_seen = time.monotonic()

    def _check_progress(self) -> None:
        self._raise_if_fatal()
        if any(w.connected for w in self._workers):
            self._last_worker_seen = time.monotonic()
        elif time.monotonic() - self._last_worker_seen > self._ext.worker_recovery_timeout:
            w = self._workers[0].task
            raise WorkerUnavailableError(
                w.index,
                w.address,
                f"no worker has answered for "
                f"{self._ext.worker_recovery_timeout:.0f}s (PHALANX_WORKER_RECOVERY_TIMEOUT)",
            )

    def _complete(self, closure: _Closure, reply: Any, dispatcher: _WorkerDispatcher) -> None:
        header = reply.header
        if header.get("status") == "ok":
            try:
                value = pickling.loads(reply.blobs[0])
            except Exception as e:  # noqa: BLE001 - the value exists but cannot be rebuilt here
                self._closure_failed(
                    closure, ProtocolError(f"the return value of {closure.id} cannot be unpickled on the chief: {e}")
                )
                return
            closure.remote_value._set_value(value)  # friend: ps.closures
            self._queue.finished()
            return
        if header.get("kind") == "ps_unavailable":
            error = ParameterServerUnavailableError(
                int(header["ps"]), str(header["address"]), f"{header['cause']} (seen by {dispatcher.task.name})"
            )
            self._set_fatal(error)
            closure.remote_value._set_error(error)  # friend: ps.closures
            self._queue.finished()
            return
        error: BaseException | None = None
        if reply.blobs:
            try:
                error = pickling.loads(reply.blobs[0])
            except Exception:  # noqa: BLE001 - fall back to the text below
                error = None
        if not isinstance(error, BaseException):
            error = RemoteError(
                str(header.get("task")),
                str(header.get("type")),
                str(header.get("message")),
                str(header.get("traceback")),
            )
        elif hasattr(error, "add_note"):
            error.add_note(
                f"(raised by {closure.id} on {header.get('task')}; remote traceback:\n{header.get('traceback')})"
            )
        self._closure_failed(closure, error)

    def _closure_failed(self, closure: _Closure, error: BaseException) -> None:
        log.info("phalanx coordinator: %s failed: %s: %s", closure.id, type(error).__name__, error)
        closure.remote_value._set_error(error)  # friend: ps.closures
        self._queue.failed(error)

    def _watch_parameter_servers(self) -> None:
        ext = self._ext
        while not self._stop.wait(ext.heartbeat_interval):
            for task, incarnation in ext.parameter_servers():
                if self._stop.is_set():
                    return
                try:
                    reply = task.call("ping")
                except (TaskUnavailableError, AuthenticationError, ProtocolError) as e:
                    if self._stop.is_set():
                        return
                    self._set_fatal(
                        e
                        if isinstance(e, ParameterServerUnavailableError)
                        else ParameterServerUnavailableError(task.index, task.address, str(e))
                    )
                    return
                if reply.header.get("incarnation") != incarnation:
                    self._set_fatal(
                        ParameterServerUnavailableError(
                            task.index, task.address, "it restarted, and its variables were lost with the old process"
                        )
                    )
                    return
