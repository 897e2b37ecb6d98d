"""The global batch a replica's input came from, carried with the batch itself.

A distributed dataset tags each per-replica batch it yields with a :class:`BatchInfo` (the size of
the global batch it was sliced from, and its ordinal in the iterator). ``strategy.run`` finds the
tag among its arguments and makes it current for the replica function, where
:func:`phalanx.nn.compute_average_loss` reads it. Because the value travels with the batch (not
in a variable the iterator overwrites one batch ahead), iterating two datasets at once,
materialising one, or running a step on an older batch all scale the loss correctly.

Example:
    >>> import torch
    >>> batch = torch.ones(4, 2)
    >>> tag(batch, BatchInfo(global_size=8, ordinal=1))
    >>> find((batch,), {})
    BatchInfo(global_size=8, ordinal=1, sliced_from=None)
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary

from phalanx import nest


@dataclass(frozen=True)
class BatchInfo:
    """Where a per-replica batch came from.

    Attributes:
        global_size: the number of examples in the global batch, over all replicas.
        ordinal: 1 for the first batch an iterator yields, 2 for the next, ...
        sliced_from: where every process reads whole global batches and takes its slice: the
            size of the batch this process sliced (it must be the same in every process).
    """

    global_size: int
    ordinal: int
    sliced_from: int | None = None


# Keyed by identity: a WeakKeyDictionary would compare tensors with ==, elementwise.
_TAGS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_CURRENT: contextvars.ContextVar[BatchInfo | None] = contextvars.ContextVar("phalanx_batch", default=None)


def tag(batch: Any, info: BatchInfo) -> None:
    """Records ``info`` on the leaves of ``batch`` (tensors or per-replica values)."""
    for leaf in nest.flatten(batch):
        try:
            _TAGS[leaf] = info
        except TypeError:  # not weak-referenceable (a Python number): nothing to carry it
            continue


def find(args: tuple, kwargs: dict) -> BatchInfo | None:
    """The tag of the first tagged leaf of ``args`` / ``kwargs``, or None."""
    if not _TAGS:
        return None
    for leaf in nest.flatten((args, kwargs)) if kwargs else nest.flatten(args):
        try:
            info = _TAGS.get(leaf)
        except TypeError:
            continue
        if info is not None:
            return info
    return None


# An elastic job's slices, by identity: slice -> (the global batch's tensor it was cut from, the
# split (parts, index) it was cut by). A step that runs again on a re-formed group, or a batch
# cut one ahead before the group changed, is cut again from the same global batch.
_SOURCES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def remember_sources(local: Any, whole: Any, split: tuple[int, int]) -> None:
    """Records, leaf by leaf, the global batch ``whole`` that ``local`` was cut from by ``split``."""
    for part, source in zip(nest.flatten(local), nest.flatten(whole)):
        if hasattr(part, "dim") and hasattr(source, "dim") and source.dim() > 0:
            _SOURCES[part] = (source, split)


# An elastic job's batches, by identity: a replica's part -> (its iterator, its place in the batch),
# so that a replacement that joins mid-pass can catch its iterator up with the group's (catch_up).
_ITERATORS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _parts(batch: Any) -> list[Any]:
    """The replica's own tensors of a batch an iterator yielded (its per-replica values unwrapped)."""
    return [
        leaf.values[0] if hasattr(leaf, "values") and isinstance(leaf.values, tuple) else leaf
        for leaf in nest.flatten(batch)
    ]


def remember_iterator(batch: Any, iterator: Any) -> None:
    """Records that ``iterator`` yielded ``batch`` (an elastic job's distributed iterator does)."""
    ref = weakref.ref(iterator)
    for index, part in enumerate(_parts(batch)):
        try:
            _ITERATORS[part] = (ref, index)
        except TypeError:
            continue


def catch_up(structure: Any, ordinal: int) -> tuple[Any, BatchInfo | None]:
    """``structure`` with its batch's parts replaced by those of batch ``ordinal`` of the same iterator,
    which is advanced to it (the batches in between are read and dropped), and that batch's tag;
    ``structure`` itself (and None) when its parts came from no such iterator, or already are of
    that batch."""
    leaves = nest.flatten(structure)
    found = next((_ITERATORS[leaf] for leaf in leaves if _known(leaf)), None)
    if found is None:
        return structure, None
    iterator = found[0]()
    tags = [_TAGS.get(leaf) for leaf in leaves if _known(leaf)]
    current = tags[0].ordinal if tags and tags[0] is not None else ordinal
    batch, later = None, None
    while iterator is not None and current < ordinal:
        batch = next(iterator)
        later = find((batch,), {})
        current = later.ordinal if later is not None else ordinal
    if batch is None:
        return structure, None
    parts = _parts(batch)

    def swap(leaf: Any) -> Any:
        where = _ITERATORS.get(leaf) if _known(leaf) else None
        return parts[where[1]] if where is not None and where[1] < len(parts) else leaf

    return nest.map_structure(swap, structure), later


def _known(leaf: Any) -> bool:
    try:
        return leaf in _ITERATORS
    except TypeError:
        return False


def follow_sources(local: Any, moved: Any) -> None:
    """``moved`` (``local`` on the replica's device) was cut from what ``local`` was."""
    if not _SOURCES:
        return
    for part, there in zip(nest.flatten(local), nest.flatten(moved)):
        try:
            found = _SOURCES.get(part)
        except TypeError:
            continue
        if found is not None:
            _SOURCES[there] = found


def recut(structure: Any, split: tuple[int, int], bounds: Any) -> Any:
    """``structure`` with every leaf cut by another split than ``split`` cut again from its global batch.

    ``bounds(size, parts, index)`` gives the rows of a part. Leaves that were not cut from a global
    batch of an elastic job are kept. Tags and sources follow the new leaves.
    """
    if not _SOURCES:
        return structure

    def again(leaf: Any) -> Any:
        try:
            found = _SOURCES.get(leaf)
        except TypeError:
            return leaf
        if found is None or found[1] == split:
            return leaf
        source = found[0]
        start, end = bounds(source.shape[0], *split)
        part = source[start:end].to(leaf.device)
        _SOURCES[part] = (source, split)
        info = _TAGS.get(leaf)
        if info is not None:
            _TAGS[part] = info
        return part

    return nest.map_structure(again, structure)


def current() -> BatchInfo | None:
    """The batch of the replica function running now (inside ``strategy.run``), or None."""
    return _CURRENT.get()


class using:  # lower case: used like a function, ``with using(info):``
    """Makes ``info`` current for the ``with`` block (``strategy.run`` does this)."""

    __slots__ = ("_info", "_token")

    def __init__(self, info: BatchInfo | None) -> None:
        self._info = info

    def __enter__(self) -> None:
        self._token = _CURRENT.set(self._info)

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)
