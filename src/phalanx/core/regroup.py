"""What TF's ``regroup`` checks, for replicas that are processes.

In TF one process holds every replica's result of ``strategy.run`` and regroups them into
per-replica values, refusing results whose structures differ. Here each replica returns its own
result in its own process; phalanx compares the structures at the first collective that reads a
result (``reduce``, ``gather``, ``experimental_local_results``, ``reduce_to``, the replica
context's collectives), by a digest each replica writes into its own slot of that collective's
message (no extra message when the collective sums float32/float64/int32/int64 values), and only
on a mismatch exchanges the descriptions, so every replica raises the same error naming each
structure.

Example:
    >>> import torch
    >>> describe((torch.ones(2), {"b": None, "a": 1.0}))
    '(Tensor, {a: float, b: None})'
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

# Digests are written into float32 slots too: below 2**24 they are exact there.
_DIGEST_MASK = (1 << 24) - 1
SLOT_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v) for v in value)
        if hasattr(value, "_fields"):  # a namedtuple
            return f"{type(value).__name__}({inner})"
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
        )
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return "Tensor"
    return type(value).__name__


def describe(structure: Any) -> str:
    """A short description of a nested structure: its nesting, keys and kinds of leaves (not shapes:
    replicas may hold batches of different lengths)."""
    return _describe(structure)


def digest(description: str) -> int:
    """A 24-bit digest of ``description``, exact in every slot dtype."""
    return zlib.crc32(description.encode()) & _DIGEST_MASK
