"""What the coordinator hands out and queues: ``RemoteValue``, per-worker datasets, the closure queue.

The queue's rules are TF's (``cluster_coordinator.py``): a function whose worker is lost is put
back at the head; when a function fails, the functions still queued are cancelled and its error
is kept until ``schedule``/``join``/``done`` raises it (once); ``join`` waits until no function
is executing.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from phalanx.ps.errors import CancelledError


class ClusterCoordinator(Protocol):
    """What closures and remote values need of their coordinator (``phalanx.ps.cluster_coordinator``
    provides it; that module imports this one)."""

    def _check_progress(self) -> None: ...

    def _dumps(self, obj: Any, resources: list[Any]) -> bytes: ...


class RemoteValue:
    """The result of a scheduled function, available once it has run.

    (``tf.distribute.experimental.coordinator.RemoteValue``.)
    """

    def __init__(self, coordinator: ClusterCoordinator, name: str) -> None:
        self._coordinator = coordinator
        self._name = name
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set_value(self, value: Any) -> None:
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def _set_error(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def done(self) -> bool:
        """Whether the function has finished (or failed, or was cancelled)."""
        return self._event.is_set()

    def fetch(self, timeout: float | None = None) -> Any:
        """Waits for the function and returns its return value (tensors on the CPU).

        Raises:
            the function's own exception; CancelledError: it was cancelled;
            ParameterServerUnavailableError: a parameter server failed first;
            WorkerUnavailableError: no worker answered for the recovery timeout;
            TimeoutError: not done within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.wait(0.05):
            # friend: ps.coordinator. A failed parameter server; no worker for too long.
            self._coordinator._check_progress()  # friend
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self._name} did not finish within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._value

    def get(self, timeout: float | None = None) -> Any:
        """Same as :meth:`fetch` (TF's ``get`` returns the tensor, ``fetch`` a numpy value)."""
        return self.fetch(timeout)

    def __repr__(self) -> str:
        state = "pending" if not self._event.is_set() else ("failed" if self._error is not None else "done")
        return f"RemoteValue({self._name}, {state})"


def _value_of(v: Any) -> Any:
    return v.fetch() if isinstance(v, RemoteValue) else v


class _Resource:
    """Something each worker builds for itself: a per-worker dataset or iterator."""

    kind = ""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:12]

    def _requirements(self) -> list[_Resource]:
        return [self]


class PerWorkerDataset(_Resource):
    """A dataset that every worker builds with ``dataset_fn`` (from ``create_per_worker_dataset``).

    ``iter()`` gives a :class:`PerWorkerIterator`; a scheduled function that takes it gets the
    iterator of the worker it runs on.
    """

    kind = "dataset"

    def __init__(self, coordinator: ClusterCoordinator, dataset_fn: Callable[..., Any]) -> None:
        super().__init__()
        self._coordinator = coordinator
        self.blob = coordinator._dumps(dataset_fn, [])  # friend: ps.coordinator

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self)

    def build(self) -> PerWorkerDataset:
        """This dataset (TF's ``PerWorkerDataset.build()``: the workers build theirs when a function needs it)."""
        return self

    def meta(self, blob_index: int) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "blob": blob_index}


class PerWorkerIterator(_Resource):
    """An iterator per worker over a :class:`PerWorkerDataset`; pass it to scheduled functions."""

    kind = "iterator"

    def __init__(self, dataset: PerWorkerDataset) -> None:
        super().__init__()
        self.dataset = dataset

    def _requirements(self) -> list[_Resource]:
        return [self.dataset, self]

    def meta(self, blob_index: int) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "dataset": self.dataset.id}

    def __next__(self) -> Any:
        raise TypeError(
            "a per-worker iterator is consumed on the workers: pass it to a function given to "
            "coordinator.schedule(fn, args=(iterator,)) and call next(iterator) there"
        )


class _Closure:
    def __init__(
        self, coordinator: ClusterCoordinator, number: int, fn: Any, payload: bytes, resources: list[_Resource]
    ) -> None:
        self.id = f"{getattr(fn, '__name__', type(fn).__name__)}#{number}"
        self.payload = payload
        self.resources = resources
        self.remote_value = RemoteValue(coordinator, self.id)


class _ClosureQueue:
    """The scheduled functions not yet finished; one condition guards everything."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self._queue: collections.deque[_Closure] = collections.deque()
        self.inflight = 0
        self._error: BaseException | None = None
        self._closed = False

    def put(self, closure: _Closure) -> None:
        with self.cv:
            self._queue.append(closure)
            self.cv.notify_all()

    def get(self, timeout: float) -> _Closure | None:
        with self.cv:
            if not self._queue and not self._closed:
                self.cv.wait(timeout)
            if self._closed or not self._queue:
                return None
            self.inflight += 1
            return self._queue.popleft()

    def put_back(self, closure: _Closure) -> None:
        with self.cv:
            self.inflight -= 1
            if self._closed or self._error is not None:
                closure.remote_value._set_error(self._cancelled())
            else:
                self._queue.appendleft(closure)
            self.cv.notify_all()

    def finished(self) -> None:
        with self.cv:
            self.inflight -= 1
            self.cv.notify_all()

    def failed(self, error: BaseException) -> None:
        with self.cv:
            self.inflight -= 1
            if self._error is None:
                self._error = error
                self.cancel_queued(self._cancelled())
            self.cv.notify_all()

    def _cancelled(self) -> CancelledError:
        why = (
            f"an earlier scheduled function failed ({type(self._error).__name__}: {self._error})"
            if self._error is not None
            else "the coordinator shut down"
        )
        return CancelledError(f"Scheduled function cancelled: {why}.")

    def cancel_queued(self, error: BaseException) -> int:
        n = len(self._queue)
        while self._queue:
            self._queue.popleft().remote_value._set_error(error)
        return n

    def close(self) -> None:
        with self.cv:
            self._closed = True
            self.cancel_queued(self._cancelled())
            self.cv.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def raise_if_error(self) -> None:
        with self.cv:
            self._raise_error()

    def pending(self) -> int:
        with self.cv:
            return len(self._queue) + self.inflight

    def wait(self, check: Callable[[], None]) -> None:
        with self.cv:
            while self._error is None and (self._queue or self.inflight):
                self.cv.wait(0.05)
                check()
            while self.inflight:  # no function is still executing when join returns or raises
                self.cv.wait(0.05)
                check()
            self._raise_error()

    def done(self) -> bool:
        with self.cv:
            self._raise_error()
            return not self._queue and not self.inflight
