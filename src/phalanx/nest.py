"""Nested structures (tuples, lists, dicts, namedtuples) of tensors, as ``tf.nest`` treats them.

phalanx's values (:class:`~phalanx.values.PerReplica`, ...) are leaves, so a structure of
per-replica values can be mapped over without unwrapping it by accident.

Example:
    >>> from phalanx import nest
    >>> nest.map_structure(lambda x: x * 2, {"a": 1, "b": (2, 3)})
    {'a': 2, 'b': (4, 6)}
"""

from __future__ import annotations

from typing import Any, Callable

from phalanx._compat.torch import pytree

# torch's pytree is the one structure walker that torch itself, torch.compile and Keras' torch
# backend agree on; reusing it keeps dicts, namedtuples and OrderedDicts handled identically.


def flatten(structure: Any) -> list[Any]:
    """Returns the leaves of ``structure`` in a deterministic order."""
    return pytree.tree_leaves(structure)


def map_structure(fn: Callable[..., Any], structure: Any, *rest: Any) -> Any:
    """Applies ``fn`` to every leaf (and the matching leaves of ``rest``)."""
    return pytree.tree_map(fn, structure, *rest)


def flatten_with_spec(structure: Any) -> tuple[list[Any], Any]:
    """Returns ``(leaves, spec)``; :func:`unflatten` inverts it."""
    return pytree.tree_flatten(structure)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """Rebuilds a structure from :func:`flatten_with_spec` output."""
    return pytree.tree_unflatten(leaves, spec)
