"""Side tables: what phalanx knows about other libraries' objects, kept by phalanx, not on them.

Attaching ``obj._phalanx_x = ...`` to a torch tensor or a Keras model changes an object phalanx
does not own (it shows up in ``__dict__``, pickles, deep copies). A side table keeps the value
beside the object instead, for as long as the object lives.

:class:`weakref.WeakKeyDictionary` compares keys with ``==``, which a tensor answers elementwise,
so the table here is keyed by *identity*: ``id(obj)`` plus a weak reference whose callback drops
the entry when the object goes away (so a reused ``id`` never finds a stale value).

Example:
    >>> import torch
    >>> from phalanx._sidetable import IdentityTable
    >>> table = IdentityTable()
    >>> t = torch.zeros(3)
    >>> table[t] = "owner"
    >>> table.get(t), t in table, len(table)
    ('owner', True, 1)
    >>> del t
    >>> len(table)
    0
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Generic, Iterator, TypeVar

V = TypeVar("V")


class IdentityTable(Generic[V]):
    """A mapping from live objects (by identity) to values; an entry goes when its object does."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, V]] = {}
        self._lock = threading.Lock()

    def __setitem__(self, obj: Any, value: V) -> None:
        key = id(obj)

        def drop(ref: weakref.ref, key: int = key) -> None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry[0] is ref:
                    del self._entries[key]

        with self._lock:
            self._entries[key] = (weakref.ref(obj, drop), value)

    def get(self, obj: Any, default: Any = None) -> Any:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return entry[1]

    def __getitem__(self, obj: Any) -> V:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            raise KeyError(f"no entry for this {type(obj).__name__}")
        return entry[1]

    def setdefault(self, obj: Any, value: V) -> V:
        existing = self.get(obj, _MISSING)
        if existing is not _MISSING:
            return existing
        self[obj] = value
        return value

    def pop(self, obj: Any, default: Any = None) -> Any:
        with self._lock:
            entry = self._entries.get(id(obj))
            if entry is None or entry[0]() is not obj:
                return default
            del self._entries[id(obj)]
            return entry[1]

    def __contains__(self, obj: Any) -> bool:
        return self.get(obj, _MISSING) is not _MISSING

    def __len__(self) -> int:
        return sum(1 for ref, _ in list(self._entries.values()) if ref() is not None)

    def values(self) -> Iterator[V]:
        return iter([v for ref, v in list(self._entries.values()) if ref() is not None])


_MISSING = object()
