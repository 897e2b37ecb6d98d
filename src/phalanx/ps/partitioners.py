"""How a large variable is split along its first axis (``tf.distribute.experimental.partitioners``).

A partitioner is called with a variable's shape and dtype and returns the number of partitions
per axis, as TF's do: ``[k, 1, 1, ...]`` splits dimension 0 into ``k`` shards. Shards follow
``torch.tensor_split``: the first ``dim0 % k`` shards get one row more.

Example:
    >>> import torch
    >>> FixedShardsPartitioner(2)((10, 3), torch.float32)
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), torch.float32)
    [2, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), torch.float32)
    [6, 1]
    >>> shard_sizes(10, 3)
    [4, 3, 3]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _element_bytes(dtype: Any, bytes_per_string: int) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    return bytes_per_string  # TF's string variables; kept for signature parity


def _check_axis(shape: Sequence[int], axis: int) -> None:
    if axis != 0:
        raise ValueError(f"phalanx partitions variables along axis 0 only; received axis={axis!r}")
    if len(shape) == 0:
        raise ValueError("a scalar variable cannot be partitioned")


class Partitioner:
    """Base class: ``partitioner(shape, dtype, axis=0) -> [num_shards, 1, ...]``."""

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards (fewer if dimension 0 is shorter).

    Raises:
        ValueError: ``num_shards`` is not a positive integer.
    """

    def __init__(self, num_shards: int) -> None:
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be a positive integer; received {num_shards!r}")
        self._num_shards = num_shards

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        _check_axis(shape, axis)
        return [max(1, min(self._num_shards, int(shape[0])))] + [1] * (len(shape) - 1)


class MinSizePartitioner(Partitioner):
    """As many shards as give each about ``min_shard_bytes`` (at most ``max_shards``).

    TF's rule: ``ceil(total_bytes / min_shard_bytes)`` capped by ``max_shards`` and dimension 0.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16) -> None:
        if min_shard_bytes < 1:
            raise ValueError(f"min_shard_bytes must be positive; received {min_shard_bytes!r}")
        if max_shards < 1:
            raise ValueError(f"max_shards must be positive; received {max_shards!r}")
        if bytes_per_string < 1:
            raise ValueError(f"bytes_per_string must be positive; received {bytes_per_string!r}")
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        _check_axis(shape, axis)
        total = math.prod(int(d) for d in shape) * _element_bytes(dtype, self._bytes_per_string)
        shards = max(1, min(int(shape[0]), self._max_shards, math.ceil(total / self._min_shard_bytes)))
        return [shards] + [1] * (len(shape) - 1)


class MaxSizePartitioner(Partitioner):
    """Shards of at most ``max_shard_bytes`` each (one row per shard at least; ``max_shards`` wins).

    TF's rule: rows per shard ``= max(1, floor(max_shard_bytes / bytes_per_row))``.
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive; received {max_shard_bytes!r}")
        if max_shards is not None and max_shards < 1:
            raise ValueError(f"max_shards must be positive; received {max_shards!r}")
        if bytes_per_string < 1:
            raise ValueError(f"bytes_per_string must be positive; received {bytes_per_string!r}")
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        _check_axis(shape, axis)
        row_bytes = math.prod(int(d) for d in shape[1:]) * _element_bytes(dtype, self._bytes_per_string)
        rows_per_shard = max(1, self._max_shard_bytes // max(1, row_bytes))
        shards = max(1, math.ceil(int(shape[0]) / rows_per_shard))
        if self._max_shards is not None:
            shards = min(shards, self._max_shards)
        return [shards] + [1] * (len(shape) - 1)


def shard_sizes(rows: int, num_shards: int) -> list[int]:
    """Rows of each shard: the first ``rows % num_shards`` shards get one more (``torch.tensor_split``)."""
    base, extra = divmod(rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def num_shards_for(partitioner: Callable[..., Sequence[int]] | None, shape: Sequence[int], dtype: torch.dtype) -> int:
    """How many shards ``partitioner`` asks for (1 without one, or for a scalar or empty variable).

    Raises:
        ValueError: the partitioner's answer is not ``[k >= 1, 1, ...]`` with ``k <= shape[0]``.
    """
    if partitioner is None or len(shape) == 0 or int(shape[0]) == 0:
        return 1
    parts = list(partitioner(tuple(int(d) for d in shape), dtype))
    if len(parts) != len(shape) or any(int(p) != 1 for p in parts[1:]) or not 1 <= int(parts[0]) <= int(shape[0]):
        raise ValueError(
            f"variable_partitioner returned {parts} for shape {list(shape)}; expected "
            f"[k, 1, ...] with 1 <= k <= {shape[0]} (partitioning along axis 0 only)"
        )
    return int(parts[0])
