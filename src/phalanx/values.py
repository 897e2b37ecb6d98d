"""Distributed values and reduction operations.

In phalanx every replica is its own process, so a distributed value in one process holds the
values of that process's *local* replicas (one, in the usual one-device-per-process layout).
The values of remote replicas are reached only through collectives
(:meth:`phalanx.Strategy.reduce`, :meth:`phalanx.Strategy.gather`).

Example:
    >>> import torch
    >>> from phalanx.values import PerReplica, ReduceOp
    >>> v = PerReplica((torch.tensor(1.0),))
    >>> v.values
    (tensor(1.),)
    >>> ReduceOp.from_any("mean") is ReduceOp.MEAN
    True
"""

from __future__ import annotations

import enum
from typing import Any, Iterator, Sequence

from phalanx.errors import ReduceOpError


class ReduceOp(enum.Enum):
    """How values of different replicas are combined (``tf.distribute.ReduceOp``)."""

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_any(cls, op: Any) -> "ReduceOp":
        """Accepts a :class:`ReduceOp` or its name in any case; raises :class:`ReduceOpError`."""
        if isinstance(op, cls):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise ReduceOpError(op)


class DistributedValues:
    """Base class of values that have one component per local replica.

    Attributes:
        values: the per-replica components held by this process, in local replica order.
    """

    def __init__(
        self, values: Sequence[Any], *, replica_ids: Sequence[int] | None = None, num_replicas: int | None = None
    ) -> None:
        """Wraps this process's replica values.

        Args:
            values: one value per local replica.
            replica_ids: the global replica id of each value (default 0, 1, ...); shown by ``repr``.
            num_replicas: the number of replicas in sync across the job, when known; ``repr`` then
                says how many of them are held here.
        """
        if not isinstance(values, (tuple, list)) or not values:
            raise TypeError(f"{type(self).__name__} needs a non-empty tuple of values; received {values!r}")
        self._values = tuple(values)
        self._replica_ids = tuple(replica_ids) if replica_ids is not None else tuple(range(len(self._values)))
        if len(self._replica_ids) != len(self._values):
            raise TypeError(f"{type(self).__name__}: {len(self._values)} values but replica_ids {self._replica_ids!r}")
        self._num_replicas = num_replicas

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def __iter__(self) -> Iterator[Any]:
        # TF's DistributedValues are not iterable; iterating would hide the per-replica nature.
        raise TypeError(
            f"{type(self).__name__} is not iterable; use strategy.experimental_local_results(value) "
            "or strategy.reduce / strategy.gather"
        )

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        # Only this process's replicas are held here; say so, so that `PerReplica({0: 1.5})` on a
        # 2-replica job is not read as the whole value.
        body = "{" + ", ".join(f"{i}: {v!r}" for i, v in zip(self._replica_ids, self._values)) + "}"
        if self._num_replicas is not None and self._num_replicas > len(self._values):
            return f"{type(self).__name__}(local replicas {body} of {self._num_replicas})"
        return f"{type(self).__name__}({body})"


class PerReplica(DistributedValues):
    """One value per replica, each possibly different (e.g. a replica's slice of the batch)."""


class Mirrored(DistributedValues):
    """One value that is the same on every replica (e.g. a mirrored parameter)."""


def mean_dtype(dtype: Any) -> Any:
    """The dtype of a mean of integers: TF's true division gives float64 for 32- and 64-bit
    integers and float32 for narrower ones; a floating dtype is its own."""
    import torch  # here: this module stays importable without torch (the launcher's processes)

    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    return torch.float64 if dtype in (torch.int32, torch.int64, torch.uint32, torch.uint64) else torch.float32


def local_results(value: Any) -> tuple[Any, ...]:
    """Unwraps a distributed value into the tuple of this process's replica values."""
    if isinstance(value, DistributedValues):
        return value.values
    return (value,)
