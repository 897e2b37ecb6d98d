"""Loss scaling for synchronous training (``tf.nn.compute_average_loss`` and friends).

Gradients are *summed* across replicas (TF's convention), so each replica's loss must be divided
by the global batch size, not its own: the sum of the replicas' gradients is then the gradient of
the mean loss over the global batch, exactly what one device computes.

What :func:`compute_average_loss` divides by: the ``global_batch_size`` you pass; without it, the
number of examples in the global batch this replica's input was sliced from (carried with the
batch by ``experimental_distribute_dataset``, so a smaller last batch is exact); without such a
batch, this replica's batch times ``num_replicas_in_sync``.

The trap it guards against: a plain mean loss (``cross_entropy(...)`` with its default
``reduction="mean"``), or the per-replica batch passed as ``global_batch_size``, makes the summed
gradient N times too large on N replicas. ``strategy.run`` warns once (:class:`LossScaleWarning`)
when a backward pass ran in a step whose loss was not scaled by :func:`compute_average_loss`
(or declared scaled with :func:`mark_loss_scaled`), and when ``global_batch_size`` is smaller than
the global batch the replica was given (a larger one is fine: accumulated micro-batches).

Example:
    >>> import torch, phalanx as px
    >>> px.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6)
    tensor(1.)
"""

from __future__ import annotations

import contextvars
import numbers
import warnings
from typing import Any

import numpy as np
import torch

from phalanx.core import context
from phalanx.errors import ContextError, user_stacklevel
from phalanx.input import global_batch
from phalanx.values import mean_dtype


class LossScaleWarning(UserWarning):
    """A loss that is probably not scaled for the global batch (the gradient would be N times too large)."""


class _Record:
    __slots__ = ("scaled",)

    def __init__(self) -> None:
        self.scaled = False


_RECORD: contextvars.ContextVar[_Record | None] = contextvars.ContextVar("phalanx_loss_record", default=None)
_warned: set[str] = set()


def _warn_once(key: str, message: str, stacklevel: int) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, LossScaleWarning, stacklevel=stacklevel + 1)


def mark_loss_scaled() -> None:
    """Declares that this step's loss is already scaled for the global batch (a custom scaling).

    Silences the warning ``strategy.run`` gives for a backward pass without
    :func:`compute_average_loss` in the step. phalanx's Keras integration calls it itself.
    """
    record = _RECORD.get()
    if record is not None:
        record.scaled = True


def _require_replica_context(name: str) -> None:
    if context.has_strategy() and context.in_cross_replica_context():
        raise ContextError(
            f"{name} was called in cross-replica context (inside scope(), outside strategy.run); "
            "TensorFlow refuses it too.",
            hint=f"call {name} inside the function given to strategy.run, on that replica's loss",
        )


def _check_global_batch_size(value: Any) -> int:
    # TF asserts a scalar (ValueError otherwise: a list, a tuple or an array of any shape but ()),
    # then an integer (TypeError otherwise), not negative; 0 is allowed and gives a 0 loss
    # (div_no_nan). Integer tensors and numpy integers are integers too.
    if type(value) is int and value >= 0:
        return value  # the usual case, first: this runs on every step
    shape = np.shape(value) if isinstance(value, (list, tuple, np.ndarray)) else ()
    if shape != ():
        raise ValueError(
            f"global_batch_size must be a scalar; received {value!r} of shape {shape} "
            "(TF: 'global_batch_size must be scalar')"
        )
    if isinstance(value, np.ndarray):
        value = value.item()
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"global_batch_size must be a scalar; received a tensor of shape {tuple(value.shape)}")
        if value.is_floating_point() or value.is_complex() or value.dtype is torch.bool:
            raise TypeError(f"global_batch_size must be an integer; received a {value.dtype} tensor {value!r}")
        value = int(value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"global_batch_size must be an integer; received {type(value).__name__} {value!r}")
    value = int(value)
    if value < 0:
        raise ValueError(f"global_batch_size must be non-negative; received {value}")
    return value


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """Sums ``per_example_loss`` (times ``sample_weight``) and divides by the global batch size.

    As TF's ``tf.nn.compute_average_loss``: a global batch of 0 examples (``global_batch_size=0``, or
    no examples anywhere) gives a loss of 0, not NaN (TF's ``div_no_nan``), and a replica whose slice
    of an uneven last batch is empty contributes 0.

    Args:
        per_example_loss: this replica's losses, one per example, of rank >= 1 (extra dimensions
            are summed).
        sample_weight: optional weights, broadcast against ``per_example_loss``.
        global_batch_size: the batch size over all replicas, an integer >= 0. Default: the size of
            the global batch the replica's input came from (exact for uneven last batches), else
            this replica's batch times ``num_replicas_in_sync``.

    Raises:
        ValueError: ``per_example_loss`` is a scalar (already averaged: the gradient would be scaled
            wrongly), or ``global_batch_size`` is negative or not a scalar.
        TypeError: ``global_batch_size`` is not an integer (e.g. ``32.0``), as TF raises.
        ContextError: called in cross-replica context (inside ``scope()``, outside ``run``) without
            ``global_batch_size``, as TF refuses it: there is no replica whose batch to count.
    """
    loss = per_example_loss if isinstance(per_example_loss, torch.Tensor) else torch.as_tensor(per_example_loss)
    if loss.dim() == 0:
        raise ValueError(
            f"compute_average_loss needs per-example losses (a tensor of rank >= 1); received a scalar {loss!r}. "
            "HINT: compute the loss with reduction='none' (or keras's Reduction.NONE), so each example has its own"
        )
    if sample_weight is not None:
        loss = loss * torch.as_tensor(sample_weight, dtype=loss.dtype, device=loss.device)
    info = global_batch.current()
    if global_batch_size is None:
        _require_replica_context("compute_average_loss")
        if info is not None:
            global_batch_size = info.global_size
        else:
            global_batch_size = loss.shape[0] * context.get_strategy().num_replicas_in_sync
    else:
        global_batch_size = _check_global_batch_size(global_batch_size)
        if info is not None and 0 < global_batch_size < info.global_size:
            # Smaller than the batch the input came from: the gradient grows (the classic trap). A larger
            # divisor is legitimate (micro-batches accumulated over several passes).
            what = " (this replica's own batch)" if global_batch_size == loss.shape[0] else ""
            _warn_once(
                "global_batch_size",
                (
                    f"compute_average_loss(global_batch_size={global_batch_size}){what}, but this replica's input is "
                    f"a slice of a global batch of {info.global_size}: the summed gradient is scaled by "
                    f"{info.global_size / global_batch_size:g}. Pass the global batch size, or leave the argument out."
                ),
                stacklevel=2,
            )  # the caller of compute_average_loss
    mark_loss_scaled()
    total = loss.sum()
    if not total.is_floating_point() and not total.is_complex():
        total = total.to(mean_dtype(total.dtype))  # integer losses: TF's true division (float64)
    # div_no_nan: no examples at all is a 0 loss, still attached to the graph (its gradient is 0).
    return total / global_batch_size if global_batch_size else total * 0


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """Sums ``regularization_loss`` and divides it by the number of replicas, so its summed
    gradient is counted once (TF's ``tf.nn.scale_regularization_loss``).

    A list of losses (a model's ``losses``) is summed too: TF's ``reduce_sum`` accepts one.

    Raises:
        ContextError: called in cross-replica context, as TF refuses it.
    """
    _require_replica_context("scale_regularization_loss")
    if isinstance(regularization_loss, (list, tuple)):
        regularization_loss = (
            torch.stack([torch.as_tensor(t).sum() for t in regularization_loss])
            if regularization_loss
            else torch.zeros(())
        )
    mark_loss_scaled()
    return torch.as_tensor(regularization_loss).sum() / context.get_strategy().num_replicas_in_sync


class loss_scale_watch:  # lower case: used like a function by strategy.run
    """Around one replica step: warns once if gradients were summed but no loss was scaled."""

    __slots__ = ("_before", "_record", "_sync", "_token", "_world_size")

    def __init__(self, sync: Any, world_size: int) -> None:
        self._sync, self._world_size = sync, world_size  # the strategy's GradientSync

    def __enter__(self) -> None:
        self._record = _Record()
        self._token = _RECORD.set(self._record)
        self._before = self._sync.passes

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        _RECORD.reset(self._token)
        if exc_type is None and not self._record.scaled and self._sync.passes != self._before:
            n = self._world_size
            _warn_once(
                "unscaled",
                (
                    f"A backward pass ran inside strategy.run on {n} replicas, but the step's loss was not made "
                    f"with phalanx.nn.compute_average_loss. Gradients are SUMMED across replicas (as in "
                    f"tf.distribute), so a loss averaged over this replica's batch (e.g. cross_entropy(...) with "
                    f"reduction='mean') gives {n} "
                    f"times the one-device gradient. Use loss = phalanx.nn.compute_average_loss(per_example_loss) with "
                    f"reduction='none', or divide by {n} yourself and call phalanx.nn.mark_loss_scaled()."
                ),
                stacklevel=user_stacklevel(),
            )  # the user's line that called strategy.run
