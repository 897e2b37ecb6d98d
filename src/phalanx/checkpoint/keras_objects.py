"""Keras objects in checkpoints: matched by the object graph, restored when their variables appear.

A Keras model's ``state_dict()`` names its tensors by Keras' auto-generated paths
(``sequential/dense/kernel``), which differ between two copies of the same model
(``sequential_1/dense_2/kernel``), and a Keras optimizer has no ``state_dict()`` at all. So
Keras objects are stored as TF stores them, by their place in the object graph, never by name:

* an object's own variables through Keras' own ``save_own_variables(store)`` /
  ``load_own_variables(store)`` (what ``model.save_weights`` uses), or, for an object without
  them (a metric), its ``variables`` in order; a single ``keras.Variable`` as one tensor;
* its children in tracking order: the sublayers (named by class and position, as Keras' own
  weights files do: ``dense``, ``dense_1``, ... whatever the layers are called), and a compiled
  model's ``optimizer`` (unless the Checkpoint names that optimizer itself).

Restoring is TF's deferred restoration: an object whose variables do not exist yet (a Keras
optimizer builds its slots at the first step; a model without an input shape builds at its first
call) keeps its saved values until it is built, and receives them the moment its ``build``
returns, before they are first used. What exists at ``restore()`` is restored at once: an unbuilt
optimizer's ``iterations`` and learning rate read the saved values right after it, and only the
slots wait for ``build`` (each variable is restored once, as in TF). A subclassed model is built
by tracing its ``call()`` symbolically, where Keras creates variables without values and an
assignment would be thrown away: there the saved value becomes the variable's initial value
instead (what TF's deferred restoration does). Nothing of Keras is imported here; objects are
recognised by the methods they have; the Keras internals relied on are behind
:mod:`phalanx._compat.keras`.

Example (``keras`` with the torch backend)::

    ckpt = Checkpoint(model=model, optimizer=model.optimizer)
    path = ckpt.save("/ckpts/ckpt")
    fresh = make_model()                     # layers get new auto names; no optimizer slots yet
    status = Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    status.pending                           # ['optimizer'] until the first training step builds it
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import numpy as np
import torch

from phalanx._compat.keras import direct_sublayers, is_uninitialized, set_initializer
from phalanx.checkpoint.errors import CheckpointMismatchError

MARK = "keras_object_graph"  # the key that marks a Keras object's state in the manifest
_VARS, _CHILDREN = "vars", "children"


# --------------------------------------------------------------------------- recognising Keras objects
def _has_own_variables(obj: Any) -> bool:
    return callable(getattr(obj, "save_own_variables", None)) and callable(getattr(obj, "load_own_variables", None))


def _is_keras_variable(obj: Any) -> bool:
    return (
        callable(getattr(obj, "assign", None))
        and hasattr(obj, "trainable")
        and hasattr(obj, "path")
        and isinstance(getattr(obj, "value", None), torch.Tensor)
        and not isinstance(obj, torch.Tensor)
    )


def _has_keras_variables(obj: Any) -> bool:
    variables = getattr(obj, "variables", None)
    return (
        not isinstance(obj, torch.nn.Module)
        and isinstance(variables, (list, tuple))
        and all(_is_keras_variable(v) for v in variables)
        and len(variables) > 0
    )


def is_keras_object(obj: Any) -> bool:
    """Whether ``obj`` is stored by this module (a Keras layer, model, optimizer, metric or variable)."""
    if isinstance(obj, torch.Tensor):
        return False
    return _has_own_variables(obj) or _is_keras_variable(obj) or _has_keras_variables(obj)


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The torch tensors behind a Keras object's variables (to find the strategy that owns them)."""
    if _is_keras_variable(obj):
        return [obj.value]
    return [v.value for v in getattr(obj, "variables", None) or () if _is_keras_variable(v)]


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _children(obj: Any, skip: set[int]) -> list[tuple[str, Any]]:
    """The object's children in the graph: sublayers in tracking order, then a model's optimizer."""
    out: list[tuple[str, Any]] = []
    layers = direct_sublayers(obj)
    if layers is None:
        layers = list(getattr(obj, "layers", None) or ())
    used: dict[str, int] = {}
    for layer in layers:
        # Keras' weights files name children this way too: by class and position, not by the
        # layer's auto-generated name, so a fresh copy of the model matches.
        base = _snake(type(layer).__name__)
        n = used.get(base, 0)
        used[base] = n + 1
        if id(layer) not in skip:
            out.append((base if n == 0 else f"{base}_{n}", layer))
    optimizer = getattr(obj, "optimizer", None) if layers or hasattr(obj, "compile") else None
    if optimizer is not None and is_keras_object(optimizer) and id(optimizer) not in skip:
        out.append(("optimizer", optimizer))
    return out


def _as_tensor(value: Any) -> torch.Tensor:
    if _is_keras_variable(value):
        value = value.value
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.as_tensor(np.asarray(value))


# --------------------------------------------------------------------------- saving
def state_of(obj: Any, skip: set[int]) -> dict[str, Any]:
    """The state tree of a Keras object: its own variables and its children's, by graph position.

    Args:
        skip: ids of objects not to descend into (the Checkpoint's own top-level objects, which
            are stored under their own names).
    """
    tree = _node_state(obj, skip, set())
    tree[MARK] = 1
    return tree


def _node_state(obj: Any, skip: set[int], seen: set[int]) -> dict[str, Any]:
    seen.add(id(obj))
    own: dict[str, torch.Tensor] = {}
    if _is_keras_variable(obj):
        own["0"] = _as_tensor(obj)
    elif _has_own_variables(obj):
        store: dict[str, Any] = {}
        obj.save_own_variables(store)
        own = {str(k): _as_tensor(v) for k, v in store.items()}
    elif _has_keras_variables(obj):
        own = {str(i): _as_tensor(v) for i, v in enumerate(obj.variables)}
    children = {key: _node_state(child, skip, seen) for key, child in _children(obj, skip | seen)}
    return {_VARS: own, _CHILDREN: children}


# --------------------------------------------------------------------------- restoring
class Pending:
    """A restoration waiting for its object's variables (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done = False

    def __repr__(self) -> str:
        return f"Pending({self.path!r}, done={self.done})"


def is_graph_state(saved: Any) -> bool:
    return isinstance(saved, dict) and saved.get(MARK) == 1


def restore(name: str, obj: Any, saved: dict[str, Any], skip: set[int]) -> tuple[list[Pending], list[str]]:
    """Restores ``saved`` (from :func:`state_of`) into ``obj``, now or when its variables appear.

    Returns:
        The deferred restorations, and the saved children the live object has no place for.

    Raises:
        CheckpointMismatchError: a built object's variables do not fit the saved ones.
    """
    pending: list[Pending] = []
    unmatched: list[str] = []
    _restore_node(name, obj, saved, skip, pending, unmatched)
    return pending, unmatched


def _built(obj: Any) -> bool:
    return bool(getattr(obj, "built", True))


def _restore_node(
    path: str,
    obj: Any,
    saved: dict[str, Any],
    skip: set[int],
    pending: list[Pending],
    unmatched: list[str],
    built: bool = False,
    start: int = 0,
) -> None:
    own = saved.get(_VARS) or {}
    children = saved.get(_CHILDREN) or {}
    if not built and not _built(obj) and (own or children and not _children(obj, skip)):
        # TF restores every variable that exists now at once (an optimizer's iterations), the
        # rest when they are created, and each only once.
        start = _restore_existing(path, obj, own)
        if start and start == len(own) and not children:
            return  # saved before it was built: nothing is left for its build to restore
        pending.append(_defer(path, obj, saved, skip, pending, unmatched, start))
        return
    if own:
        _load_own(path, obj, own, start)
    live = dict(_children(obj, skip))
    for key, sub in children.items():
        if key in live:
            _restore_node(f"{path}/{key}", live[key], sub, skip, pending, unmatched)
        elif sub.get(_VARS) or sub.get(_CHILDREN):
            unmatched.append(f"{path}/{key}")


def _is_optimizer(obj: Any) -> bool:
    # A Keras optimizer: its own variables are ``variables`` in creation order (iterations and the
    # learning rate first, at construction; the slots appended by ``build``).
    return callable(getattr(obj, "apply_gradients", None)) and hasattr(obj, "iterations") and _has_own_variables(obj)


def _restore_existing(path: str, obj: Any, own: dict[str, torch.Tensor]) -> int:
    """Restores the variables an unbuilt optimizer already has; returns how many (0 for other objects).

    A Keras optimizer saves ``variables`` in creation order, and its ``build`` only appends to
    them, so those of an unbuilt one are the first entries of the saved ones.
    """
    variables = list(getattr(obj, "variables", None) or ()) if _is_optimizer(obj) else []
    if not variables or not own:
        return 0
    if len(variables) > len(own):
        raise CheckpointMismatchError(
            path,
            f"{type(obj).__name__} has {len(variables)} variables before it is built, the checkpoint holds {len(own)}",
            hint="restore into an optimizer made the same way as the one saved",
        )
    _assign(path, obj, variables, own, 0)
    return len(variables)


def _assign(path: str, obj: Any, targets: list[Any], own: dict[str, torch.Tensor], start: int) -> None:
    try:
        for i in range(start, len(targets)):
            targets[i].assign(own[str(i)])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointMismatchError(
            path,
            f"{type(obj).__name__} refused the saved variables: {str(e).strip()[:400]}",
            hint="restore into an object built the same way as the one saved",
        ) from e


def _load_own(path: str, obj: Any, own: dict[str, torch.Tensor], start: int = 0) -> None:
    """Restores ``obj``'s own variables from ``own``, except the first ``start`` (restored already)."""
    if _is_keras_variable(obj):
        targets = [obj]
    elif _has_own_variables(obj) and not start:
        targets = None
    else:
        targets = list(obj.variables)  # an optimizer built since its first variables were restored
    count = len(targets) if targets is not None else _own_variable_count(obj)
    if count is not None and count != len(own):
        raise CheckpointMismatchError(
            path,
            f"{type(obj).__name__} has {count} variables here, the checkpoint holds {len(own)}",
            hint="restore into an object built the same way as the one saved",
        )
    if _initialize_from(path, obj, targets, own, start):
        return
    if targets is not None:
        _assign(path, obj, targets, own, start)
        return
    try:
        obj.load_own_variables(dict(own))
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointMismatchError(
            path,
            f"{type(obj).__name__} refused the saved variables: {str(e).strip()[:400]}",
            hint="restore into an object built the same way as the one saved",
        ) from e


def _uninitialized(variable: Any) -> bool:
    # Keras creates variables without a value inside a StatelessScope (a subclassed model is
    # built by tracing its call() symbolically) and gives them one from their initializer when
    # the scope ends; an assignment inside the scope would be thrown away.
    return is_uninitialized(variable)


def _initialize_from(
    path: str, obj: Any, targets: list[Any] | None, own: dict[str, torch.Tensor], start: int = 0
) -> bool:
    """Makes the saved values the initial values of variables that have none yet; True if it did.

    This is TF's deferred restoration proper: the restored value replaces the initializer. Only
    for variables Keras has not initialized; every other variable is assigned. The first
    ``start`` targets were restored already and are left alone.
    """
    if targets is None:
        store: dict[str, Any] = {}
        obj.save_own_variables(store)  # Keras' own layers put the variables themselves in the store
        pairs = list(store.items())
    else:
        pairs = [(str(i), v) for i, v in enumerate(targets) if i >= start]
    if not any(_uninitialized(v) for _, v in pairs):
        return False
    for key, variable in pairs:
        value = own.get(key)
        if value is None or not (_uninitialized(variable) or _is_keras_variable(variable)):
            raise CheckpointMismatchError(
                path,
                f"{type(obj).__name__} is being built without values for its "
                f"variables and keeps them in a way phalanx cannot restore into",
                hint="build the object before restoring (call it once on an input)",
            )
        shape = tuple(getattr(variable, "shape", value.shape))
        if shape != tuple(value.shape):
            raise CheckpointMismatchError(
                path,
                f"variable {key} has shape {shape} here, {tuple(value.shape)} in the checkpoint",
                hint="restore into an object built the same way as the one saved",
            )
        if _uninitialized(variable):
            set_initializer(variable, _Constant(value))
        else:
            variable.assign(value)
    return True


class _Constant:
    """An initializer that returns the restored value (Keras calls it as ``init(shape, dtype=...)``)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def __call__(self, shape: Any, dtype: Any = None) -> torch.Tensor:
        return self.value.clone()


def _own_variable_count(obj: Any) -> int | None:
    """How many entries ``save_own_variables`` writes for ``obj`` now (None: it cannot be told)."""
    store: dict[str, Any] = {}
    try:
        obj.save_own_variables(store)
    except Exception:  # noqa: BLE001 - a custom object may refuse while unbuilt; let load decide
        return None
    return len(store)


def _defer(
    path: str,
    obj: Any,
    saved: dict[str, Any],
    skip: set[int],
    pending: list[Pending],
    unmatched: list[str],
    start: int = 0,
) -> Pending:
    """Applies ``saved`` right after ``obj.build`` next returns (its variables exist then).

    The first ``start`` own variables were restored at once: they are not restored again, so a
    value the program set in between (a new learning rate) stays.
    """
    entry = Pending(path)
    build = getattr(obj, "build", None)
    if not callable(build):
        raise CheckpointMismatchError(
            path,
            f"{type(obj).__name__} is not built and has no build() through which its variables could be restored later",
            hint="build the object (call it once, or build(input_shape)) before restoring",
        )
    had_own = "build" in vars(obj)
    previous = vars(obj).get("build")

    @functools.wraps(build)
    def build_then_restore(*args: Any, **kwargs: Any) -> Any:
        result = build(*args, **kwargs)
        _put_back(obj, had_own, previous)
        if not entry.done:
            entry.done = True
            # Its variables exist now (``built`` may be set only after build returns).
            _restore_node(path, obj, saved, skip, pending, unmatched, built=True, start=start)
        return result

    # Instance-level and undone at the first build: Keras' own layers keep their build wrapper on
    # the instance too, and nothing else of the object or its class changes.
    object.__setattr__(obj, "build", build_then_restore)
    return entry


def _put_back(obj: Any, had_own: bool, previous: Callable[..., Any] | None) -> None:
    if had_own:
        object.__setattr__(obj, "build", previous)
    else:
        vars(obj).pop("build", None)
