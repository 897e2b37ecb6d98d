"""Keras models under :class:`~phalanx.FullyShardedStrategy`: each trainable weight split across replicas.

A Keras layer on torch keeps each weight twice: as the ``keras.Variable`` its ``call`` reads
(``variable.value``) and as a parameter of the model's ``ParameterDict`` s (what torch sees).
FSDP2 shards by replacing the module's parameters (a sharded DTensor at rest, the gathered tensor
during forward and backward), so the variables would go on reading tensors nobody updates. Here,
when the strategy shards a Keras model (one group: Keras' layers are not torch sub-modules of it):

* each trainable floating-point variable is adapted (its instance's class, never Keras' class) to
  read its tensor from the model's parameter dict, whatever FSDP2 put there: the gathered
  parameter inside the step, the 1/N shard outside. ``assign`` (``set_weights``, loading weights)
  cuts a whole value to this replica's shard; ``numpy()`` (``get_weights``, saving) gathers the
  whole value, a collective that every replica must reach, as every replica runs the program.
* variables a step updates in place (BatchNormalization's statistics), frozen ones and integer
  ones (random seeds) stay whole on every replica, as under Mirrored: FSDP2 would not write an
  in-place update of the gathered tensor back to the shards.
* a Keras optimizer's slots (momentum, Adam's moments) are cut to the shard of their weight when
  created, so the update is the one-device update applied to this replica's 1/N.
* Keras' step gives each replica's gradient the weight of its share of the global batch through a
  hook on the gathered parameter (what autograd sees), before FSDP2's reduce-scatter sums them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import keras
import numpy as np
import torch

from phalanx._compat import keras as compat_keras
from phalanx._sidetable import IdentityTable
from phalanx.errors import ShardingError
from phalanx.strategies.fully_sharded import SHARDING_ADAPTERS, Sharded, ShardingAdaptation

# A sharded variable -> the gathered parameter autograd computes its gradient for (FSDP2 keeps
# the same tensor object from step to step, freeing and refilling its storage).
_GATHERED: IdentityTable[torch.nn.Parameter] = IdentityTable()
_SHARD: IdentityTable[torch.nn.Parameter] = IdentityTable()  # a sharded variable -> its shard (a DTensor)
_ADAPTED_OPTIMIZERS: IdentityTable[bool] = IdentityTable()
_CLASSES: dict[type, type] = {}
_KERAS_VERSION = tuple(int(part) for part in keras.__version__.split(".")[:2] if part.isdigit())


def _fsdp_module() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _dtensor() -> Any:
    from torch.distributed import tensor

    return tensor


class _ShardedVariable(compat_keras.StoredElsewhere):
    """A sharded Keras weight's class (a subclass of its own class, made per class)."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self.value  # type: ignore[attr-defined]
        if isinstance(value, _dtensor().DTensor):
            value = value.full_tensor()  # collective: every replica gathers, as every one runs the program
        # A copy: an array sharing a gathered parameter's storage would pin it (torch makes storage
        # a NumPy array views unresizable), and FSDP2 frees it by resizing it to nothing.
        array = value.detach().cpu().clone().numpy()
        return array.astype(dtype) if dtype else array

    def numpy(self) -> np.ndarray:
        return self.__array__()


def shards_models(strategy: Any) -> bool:
    """Whether ``strategy`` shards the models built in its scope (FullyShardedStrategy, with collectives)."""
    return isinstance(strategy.extended.gradient_sync, Sharded) and strategy.num_replicas_in_sync > 1


def is_sharded(variable: Any) -> bool:
    """Whether ``variable`` is a Keras weight (or an optimizer slot of one) split across replicas."""
    return isinstance(variable, _ShardedVariable)


def gathered_parameter(variable: Any) -> torch.nn.Parameter | None:
    """The whole parameter autograd sees for a sharded ``variable`` (during the step), else None."""
    return _GATHERED.get(variable)


def _copy_into(read: Callable[[], torch.Tensor], value: Any) -> None:
    """An assignment to a sharded variable: a whole value (``set_weights``, a loaded file, a
    restored checkpoint) is cut, and this replica keeps its shard of it."""
    current = read()
    dtensor = _dtensor()
    value = torch.as_tensor(value)
    with torch.no_grad():
        if isinstance(current, dtensor.DTensor) and not isinstance(value, dtensor.DTensor):
            value = dtensor.distribute_tensor(
                value.to(device=current.device, dtype=current.dtype),
                current.device_mesh,
                current.placements,
                src_data_rank=None,
            )
        current.copy_(value)


def _keep_in(variable: Any, read: Callable[[], torch.Tensor]) -> None:
    """Adapts ``variable`` (its instance's class) to hold whatever ``read()`` returns now."""
    if not is_sharded(variable):
        base = type(variable)
        cls = _CLASSES.get(base)
        if cls is None:
            cls = _CLASSES[base] = type(base.__name__, (_ShardedVariable, base), {"__module__": base.__module__})
        variable.__class__ = cls
    compat_keras.store_elsewhere(variable, read, functools.partial(_copy_into, read))


def _constant(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor


def adapt(root: torch.nn.Module) -> ShardingAdaptation | None:
    """The sharding of a Keras model (an adapter of :data:`phalanx.strategies.fully_sharded.SHARDING_ADAPTERS`)."""
    if not isinstance(root, keras.layers.Layer):
        return None
    if _KERAS_VERSION < (3, 7):
        # Keras 3.6 converts a variable to a tensor only if its class is exactly Keras' own; the
        # adapted one would be copied through NumPy, without gradients.
        raise ShardingError(
            keras.__version__, "sharding a Keras model needs Keras >= 3.7", hint="pip install -U 'keras>=3.7'"
        )
    where: dict[int, tuple[torch.nn.ParameterDict, str]] = {}
    for module in root.modules():
        if isinstance(module, torch.nn.ParameterDict):
            for key, p in module.items():
                where.setdefault(id(p), (module, key))
    sharded: list[tuple[Any, torch.nn.ParameterDict, str]] = []
    ignored: set[torch.nn.Parameter] = set()
    for variable in {id(v): v for v in root.variables}.values():  # a variable a model tracks twice, once
        p = compat_keras.stored_value(variable)
        if not isinstance(p, torch.nn.Parameter) or id(p) not in where:
            continue
        if variable.trainable and p.is_floating_point() and p.requires_grad:
            sharded.append((variable, *where[id(p)]))
        else:
            ignored.add(p)

    layers = _layers_of(root)

    def after(module: torch.nn.Module) -> None:
        module.unshard()  # type: ignore[operator] # an FSDPModule now: its gathered parameters, once
        for variable, holder, key in sharded:
            _GATHERED[variable] = holder[key]
        module.reshard()  # type: ignore[operator]
        for variable, holder, key in sharded:
            _SHARD[variable] = holder[key]
        # Each layer's own dict still holds the replaced parameters (FSDP2 swaps those of the
        # model's dicts): give it the shards, so layer.parameters() are the model's.
        shards = {key: holder[key] for _, holder, key in sharded}
        for layer in layers:
            own = layer.torch_params
            for key in [k for k in own if k in shards]:
                own[key] = shards[key]
        for variable, holder, key in sharded:
            _keep_in(variable, functools.partial(holder.__getitem__, key))
        _clear_shards_too(module, [_SHARD[variable] for variable, _, _ in sharded])

    return ShardingAdaptation(ignored, after, parts=layers)


def _layers_of(root: Any) -> list[Any]:
    """Every layer inside ``root``, nested models' too (Keras tracks them; torch does not see them)."""
    found: dict[int, Any] = {}
    stack = list(compat_keras.direct_sublayers(root) or [])
    while stack:
        layer = stack.pop()
        if id(layer) not in found:
            found[id(layer)] = layer
            stack += compat_keras.direct_sublayers(layer) or []
    return list(found.values())


def adapt_optimizer(optimizer: Any) -> None:
    """Cuts the slots a Keras ``optimizer`` creates for a sharded weight to that weight's shard, and
    applies its updates with plain scalars (the learning rate, a step count) taken as replicated
    (DTensor's ``implicit_replication``). Idempotent."""
    if optimizer is None or optimizer in _ADAPTED_OPTIMIZERS:
        return
    _ADAPTED_OPTIMIZERS[optimizer] = True
    add = optimizer.add_variable_from_reference
    apply = optimizer.apply

    def add_variable_from_reference(reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
        slot = add(reference_variable, *args, **kwargs)
        # The shard, whether the model's parameters are gathered now or not (Keras builds the
        # optimizer after a symbolic call of the model, which leaves them gathered).
        reference = _SHARD.get(reference_variable)
        if isinstance(reference, _dtensor().DTensor):
            whole = compat_keras.stored_value(slot)
            shard = _dtensor().distribute_tensor(
                whole.detach(), reference.device_mesh, reference.placements, src_data_rank=None
            )
            # Adapted as the weights are: an assignment (a restored checkpoint) is cut to the shard.
            _keep_in(slot, _constant(torch.nn.Parameter(shard, requires_grad=False)))
        return slot

    def sharded_apply(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor.experimental import implicit_replication

        with implicit_replication():
            return apply(*args, **kwargs)

    # object.__setattr__: instance attributes (Keras calls self.<name>), untracked by Keras.
    object.__setattr__(
        optimizer, "add_variable_from_reference", functools.update_wrapper(add_variable_from_reference, add)
    )
    object.__setattr__(optimizer, "apply", functools.update_wrapper(sharded_apply, apply))


def _clear_shards_too(model: torch.nn.Module, shards: list[torch.nn.Parameter]) -> None:
    """Makes ``model.zero_grad()`` (this instance's) clear the shards' gradients too.

    A Keras model holds its gathered parameters from forward to backward, and Keras' step (and a
    custom loop written in its order) calls ``zero_grad`` after the forward pass: torch's would
    clear the gathered parameters' gradients only, and the shards' gradients, which FSDP2 adds
    the next step's to, would carry over.
    """
    original = model.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        original(set_to_none)
        for shard in shards:
            if set_to_none:
                shard.grad = None
            elif shard.grad is not None:
                shard.grad.zero_()

    # object.__setattr__: an instance attribute, untracked by Keras and torch.
    object.__setattr__(model, "zero_grad", functools.update_wrapper(zero_grad, original))


def reshard(model: Any) -> None:
    """Frees the gathered weights of a sharded ``model`` after an inference step.

    A Keras model keeps its weights gathered from forward to the end of backward (see
    :func:`adapt`); a step without backward (``evaluate``, ``predict``) would leave them gathered.
    """
    release = getattr(model, "reshard", None)  # FSDP2's FSDPModule.reshard
    if callable(release):
        release()


@contextlib.contextmanager
def gathered(model: Any) -> Iterator[None]:
    """Inside, a sharded ``model``'s weights are whole on every replica (FSDP2's ``unshard``, a
    collective: every replica enters); nothing for any other model."""
    if not any(is_sharded(v) for v in model.trainable_weights):
        yield
        return
    model.unshard()
    # The optimizer's slots too (each replica holds its part): whole while the chief writes them.
    optimizer = getattr(model, "optimizer", None)
    slots = [v for v in getattr(optimizer, "variables", []) if is_sharded(v)]
    shards = [compat_keras.stored_value(v) for v in slots]
    for v, shard in zip(slots, shards):
        _keep_in(v, _constant(torch.nn.Parameter(shard.full_tensor(), requires_grad=False)))
    # Keras saves the model's class by name: its own, not the one FSDP2 made for the instance
    # (FSDP<name>, which no program can load); FSDP2's methods are not used while saving.
    sharded_class = type(model)
    model.__class__ = next(c for c in sharded_class.__bases__ if not issubclass(c, _fsdp_module()))
    try:
        yield
    finally:
        model.__class__ = sharded_class
        for v, shard in zip(slots, shards):
            _keep_in(v, _constant(shard))
        model.reshard()


# Keras callbacks that read a model's weights on the chief alone (phalanx runs writers there only).
_READS_WEIGHTS = ("ModelCheckpoint", "BackupAndRestore")


def check_callbacks(callbacks: list[Any]) -> None:
    """Refuses the callbacks that would read a sharded model's weights on the chief alone.

    Gathering a weight is a collective: on the chief alone it would wait for the other replicas
    forever.

    Raises:
        ShardingError: a ModelCheckpoint or BackupAndRestore, or a TensorBoard writing histograms.
    """
    for cb in callbacks:
        name = type(cb).__name__
        if name in _READS_WEIGHTS or (name == "TensorBoard" and getattr(cb, "histogram_freq", 0)):
            raise ShardingError(
                name,
                "this callback reads the model's weights on the chief alone; under FullyShardedStrategy "
                "every replica holds a part of them",
                hint="save after fit with model.save / save_weights (every replica calls it), or checkpoint a "
                "custom loop with phalanx.checkpoint.Checkpoint",
            )


if adapt not in SHARDING_ADAPTERS:
    SHARDING_ADAPTERS.append(adapt)
