"""What a distributed dataset yields: ``element_spec`` and ``get_next_as_optional``'s Optional.

Example:
    >>> import torch
    >>> from phalanx.input.element_spec import Optional, spec_of
    >>> spec_of((torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)))
    (TensorSpec(shape=(None, 3), dtype=torch.float32), TensorSpec(shape=(None,), dtype=torch.int64))
    >>> Optional.empty().has_value()
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from phalanx import nest
from phalanx.errors import PhalanxError


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a per-replica batch (``tf.TensorSpec``).

    The batch dimension is ``None``: a replica's slice may be shorter at the end of the data.
    """

    shape: tuple[int | None, ...]
    dtype: torch.dtype


def spec_of(element: Any) -> Any:
    """The structure of :class:`TensorSpec` describing ``element`` (non-tensors are kept as they are)."""

    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return TensorSpec((None, *leaf.shape[1:]) if leaf.dim() else (), leaf.dtype)
        return leaf

    return nest.map_structure(one, element)


class EmptyOptionalError(PhalanxError, LookupError):
    """``get_value()`` of an Optional without a value (the input is exhausted)."""


class Optional:
    """A value that may be absent (``tf.experimental.Optional``), from ``get_next_as_optional``."""

    __slots__ = ("_has", "_value")

    def __init__(self, value: Any = None, has_value: bool = True) -> None:
        self._value, self._has = value, has_value

    @staticmethod
    def from_value(value: Any) -> Optional:
        return Optional(value, True)

    @staticmethod
    def empty(element_spec: Any = None) -> Optional:
        return Optional(None, False)

    def has_value(self) -> bool:
        """Whether there is a value; the same on every replica (the end of data is agreed)."""
        return self._has

    def get_value(self) -> Any:
        """The value.

        Raises:
            EmptyOptionalError: there is none.
        """
        if not self._has:
            raise EmptyOptionalError(
                "get_value() of an empty Optional: the distributed dataset is exhausted.",
                hint="check has_value() first",
            )
        return self._value

    @property
    def element_spec(self) -> Any:
        return spec_of(self._value) if self._has else None

    def __repr__(self) -> str:
        return f"Optional({self._value!r})" if self._has else "Optional(empty)"
