"""Extension point for variables split into shards (ParameterServerStrategy's ``ShardedVariable``).

A checkpoint always stores *full* tensors. A sharded variable is concatenated on save and split
into however many shards the restoring program uses, so a variable saved as 2 shards restores
into 3 shards, into 1, or into a plain tensor with no strategy at all (as TF's ``ShardedVariable``
checkpoints do). The manifest records the layout it was saved with, for information only.

A sharded type joins in one of two ways:

* it implements the protocol itself: ``_phalanx_full_tensor_() -> Tensor``,
  ``_phalanx_assign_full_(tensor)`` and optionally ``_phalanx_layout_() -> dict``;
* or its owner registers it: :func:`register_sharded_type`.

``to_full`` runs on every process during ``save`` (before the chief writes), so it may use
collectives or RPC to fetch remote shards.

Example:
    >>> import torch
    >>> from phalanx.checkpoint.sharded_variables import split_full
    >>> [tuple(s.shape) for s in split_full(torch.zeros(10, 4), 3)]
    [(4, 4), (3, 4), (3, 4)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class _ShardedCodec:
    cls: type
    to_full: Callable[[Any], torch.Tensor]
    assign_full: Callable[[Any, torch.Tensor], None]
    layout: Callable[[Any], dict] | None


_REGISTRY: list[_ShardedCodec] = []


def register_sharded_type(
    cls: type,
    *,
    to_full: Callable[[Any], torch.Tensor],
    assign_full: Callable[[Any, torch.Tensor], None],
    layout: Callable[[Any], dict] | None = None,
) -> None:
    """Teaches checkpoints to store instances of ``cls`` as one full tensor.

    Args:
        cls: the sharded variable type.
        to_full: returns the concatenation of all shards (may be a collective).
        assign_full: splits a full tensor into the instance's current shards, in place.
        layout: describes the instance's sharding for the manifest, e.g. ``{"axis": 0, "shards": [5, 5]}``.
    """
    _REGISTRY.append(_ShardedCodec(cls, to_full, assign_full, layout))


def _codec(obj: Any) -> _ShardedCodec | None:
    if hasattr(obj, "_phalanx_full_tensor_") and hasattr(obj, "_phalanx_assign_full_"):
        return _ShardedCodec(
            type(obj),
            lambda o: o._phalanx_full_tensor_(),
            lambda o, t: o._phalanx_assign_full_(t),
            (lambda o: o._phalanx_layout_()) if hasattr(obj, "_phalanx_layout_") else None,
        )
    for codec in reversed(_REGISTRY):
        if isinstance(obj, codec.cls):
            return codec
    return None


def is_sharded(obj: Any) -> bool:
    return _codec(obj) is not None


def full_tensor(obj: Any) -> tuple[torch.Tensor, dict]:
    """The full tensor of a sharded variable and the layout it was saved with."""
    codec = _codec(obj)
    assert codec is not None
    layout = codec.layout(obj) if codec.layout is not None else {}
    return codec.to_full(obj), {"type": f"{codec.cls.__module__}.{codec.cls.__qualname__}", **layout}


def assign_full(obj: Any, tensor: torch.Tensor) -> None:
    codec = _codec(obj)
    assert codec is not None
    codec.assign_full(obj, tensor)


def split_full(tensor: torch.Tensor, num_shards: int, axis: int = 0) -> list[torch.Tensor]:
    """Splits ``tensor`` along ``axis`` into ``num_shards`` near-equal parts (first ones larger).

    This is TF's ``fixed_shards`` partitioning, and the same rule phalanx uses to split batches.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1; received {num_shards}")
    base, extra = divmod(tensor.shape[axis], num_shards)
    sizes = [base + (1 if i < extra else 0) for i in range(num_shards)]
    return list(torch.split(tensor, sizes, dim=axis))
