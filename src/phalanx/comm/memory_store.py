"""A key-value store in memory, for the ranks of one process (threads) or a single replica.

It offers the subset of ``torch.distributed.Store`` phalanx uses (set, get, add, check, wait), so
code written against the job's store runs unchanged on :class:`~phalanx.comm.threaded.ThreadedCommunicator`
and :class:`~phalanx.comm.communicator.LocalCommunicator`.

Example:
    >>> store = InMemoryStore()
    >>> store.add("count", 2)
    2
    >>> store.set("name", "x"); store.get("name")
    b'x'
"""

from __future__ import annotations

import threading
import time


class InMemoryStore:
    """The subset of ``torch.distributed.Store`` phalanx uses, for threads of one process."""

    def __init__(self, timeout: float = 30.0) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self.timeout_s = timeout

    def set(self, key: str, value: str | bytes) -> None:
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def wait(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"store keys {[k for k in keys if k not in self._data]} not set within {self.timeout_s}s"
                    )
                self._cond.wait(left)
