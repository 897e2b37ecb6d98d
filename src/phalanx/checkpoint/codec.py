"""State trees to (JSON, tensors) and back: the only way state reaches or leaves a checkpoint.

A state tree is what ``state_dict()`` returns: dicts, lists and tuples of tensors, numbers,
strings, booleans and None (an optimizer's ``param_groups`` and its integer-keyed ``state``
included). :func:`encode` splits it into a JSON document that keeps the structure and every
non-tensor value, and a flat ``{key: tensor}`` dict. A tensor's key is its path in the tree,
``"/"``-joined (``"0.weight"`` for a module, ``"state/0/exp_avg"`` for an optimizer), so a
module's tensor file is its ``state_dict`` and loads with plain ``torch.load``.

Dicts with string keys stay JSON objects; other containers are tagged (``{"__tuple__": [...]}``,
``{"__dict__": [[key, value], ...]}`` for integer or ``"__"``-prefixed keys), so tuples stay tuples
and integer keys stay integers. Floats (``nan`` and ``inf`` included) round-trip exactly. Sharded variables (:mod:`phalanx.checkpoint.sharded_variables`) become one full tensor.

Example:
    >>> import torch
    >>> from phalanx.checkpoint.codec import encode, decode
    >>> doc, tensors = encode({"lr": 0.1, "betas": (0.9, 0.999), "w": torch.ones(2)})
    >>> sorted(tensors)
    ['w']
    >>> state = decode(doc, tensors)
    >>> state["betas"], state["w"]
    ((0.9, 0.999), tensor([1., 1.]))
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phalanx.checkpoint import distributed, sharded_variables
from phalanx.checkpoint.errors import CheckpointMismatchError, UnsupportedStateError

_PRIMITIVES = (str, int, float, bool, type(None))


def encode(tree: Any, *, label: str = "", materialize: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    """Splits ``tree`` into a JSON-able document and ``{path: tensor}``.

    Args:
        label: names the tree in error messages (the checkpoint object's name).
        materialize: make the tensors ready to write (on the CPU, compact); processes that do
            not write skip the copies.
    """
    tensors: dict[str, torch.Tensor] = {}

    def tensor_ref(t: torch.Tensor, path: str, layout: dict | None = None) -> dict:
        key = path or "tensor"
        n = 1
        while key in tensors:  # two paths that print the same ("a/b" as one key or two)
            n += 1
            key = f"{path}#{n}"
        # A DTensor stays as it is: every replica writes its own shards (phalanx.checkpoint.distributed).
        tensors[key] = _to_storable(t) if materialize and not distributed.is_distributed(t) else t
        ref: dict[str, Any] = {"__tensor__": key}
        if layout:
            ref["layout"] = layout
        return ref

    def walk(value: Any, path: str) -> Any:
        if not isinstance(value, _PRIMITIVES) and sharded_variables.is_sharded(value):
            full, layout = sharded_variables.full_tensor(value)
            return tensor_ref(full, path, layout)
        if isinstance(value, torch.Tensor):
            return tensor_ref(value, path)
        if isinstance(value, np.ndarray):
            ref = tensor_ref(torch.from_numpy(np.ascontiguousarray(value)), path)
            ref["numpy"] = True
            return ref
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, _PRIMITIVES):
            return value
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: walk(v, _join(path, k)) for k, v in value.items()}
            return {"__dict__": [[walk_key(k, path), walk(v, _join(path, k))] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tuple__": [walk(v, _join(path, i)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return {"__list__": [walk(v, _join(path, i)) for i, v in enumerate(value)]}
        raise UnsupportedStateError(_join(label, path) if path else (label or "<root>"), value)

    def walk_key(key: Any, path: str) -> Any:
        if isinstance(key, _PRIMITIVES):
            return key
        if isinstance(key, tuple) and all(isinstance(k, _PRIMITIVES) for k in key):
            return {"__tuple__": list(key)}
        raise UnsupportedStateError(f"{_join(label, path)}[key {key!r}]", key)

    doc = walk(tree, "")
    return doc, tensors


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _to_storable(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu")
    # torch.save writes a tensor's whole storage: copy views of bigger buffers (gradient buckets,
    # CentralStorage's shared mapping) so the file holds this tensor only.
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def decode(doc: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuilds the state tree from :func:`encode`'s output (tensors come back on the CPU)."""
    if isinstance(doc, _PRIMITIVES):
        return doc
    if isinstance(doc, list):  # keys of tuple-keyed dicts
        return [decode(v, tensors) for v in doc]
    if not isinstance(doc, dict):
        raise CheckpointMismatchError("<manifest>", f"unexpected entry {doc!r:.80}")
    if not any(k.startswith("__") for k in doc):  # a dict with plain string keys
        return {k: decode(v, tensors) for k, v in doc.items()}
    if "__tensor__" in doc:
        key = doc["__tensor__"]
        if key not in tensors:
            raise CheckpointMismatchError(key, "the manifest names a tensor its data file does not hold")
        t = tensors[key]
        return t.numpy() if doc.get("numpy") else t
    if "__dict__" in doc:
        return {_decode_key(k): decode(v, tensors) for k, v in doc["__dict__"]}
    if "__tuple__" in doc:
        return tuple(decode(v, tensors) for v in doc["__tuple__"])
    if "__list__" in doc:
        return [decode(v, tensors) for v in doc["__list__"]]
    if "__dtype__" in doc:
        dtype = getattr(torch, str(doc["__dtype__"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointMismatchError("<manifest>", f"unknown dtype {doc['__dtype__']!r}")
        return dtype
    raise CheckpointMismatchError("<manifest>", f"unexpected entry {doc!r:.80}")


def _decode_key(key: Any) -> Any:
    if isinstance(key, dict) and "__tuple__" in key:
        return tuple(key["__tuple__"])
    return key
