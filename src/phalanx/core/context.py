"""Which strategy is current, and whether code runs in replica or cross-replica context.

As in ``tf.distribute``:

* outside any ``scope()`` the *default strategy* is current and code is in its (default) replica
  context;
* inside ``strategy.scope()`` and outside ``strategy.run`` code is in *cross-replica* context;
* inside the function given to ``strategy.run`` code is in *replica* context, and
  ``get_replica_context()`` returns the replica's :class:`ReplicaContext`;
* inside ``ReplicaContext.merge_call``'s function code is in cross-replica context again.

The stack lives in a :class:`contextvars.ContextVar`, so threads (and asyncio tasks) each have
their own, and two strategies can be active in two threads of one test.

Example:
    >>> import phalanx as px
    >>> px.in_cross_replica_context(), px.has_strategy()
    (False, False)
    >>> strategy = px.OneDeviceStrategy("cpu")
    >>> with strategy.scope():
    ...     px.in_cross_replica_context(), px.get_strategy() is strategy
    (True, True)
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from phalanx import nest
from phalanx.comm.flight_recorder import recording
from phalanx.errors import ContextError, NotCallableError, StrategyScopeError
from phalanx.values import DistributedValues, ReduceOp, local_results


class Strategy(Protocol):
    """What the scope stack needs of a strategy (``phalanx.Strategy`` provides it): this module
    sits below the strategy module, which imports it, so it names the members it uses."""

    _is_default: bool

    @property
    def extended(self) -> Any: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    def scope(self) -> contextlib.AbstractContextManager[Any]: ...

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, options: Any = None) -> Any: ...

    def reduce(self, reduce_op: Any, value: Any, axis: Any = None) -> Any: ...

    def gather(self, value: Any, axis: int) -> Any: ...

    def _wrap_local(self, structure: Any) -> Any: ...


@dataclass(frozen=True)
class _Frame:
    strategy: "Strategy"
    replica_context: "ReplicaContext | None"  # None: cross-replica context


_STACK: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar("phalanx_context", default=())


def _top() -> _Frame | None:
    stack = _STACK.get()
    return stack[-1] if stack else None


class _push:  # lower case: used like the function it replaces
    """Makes ``frame`` current for the ``with`` block.

    A class rather than a ``@contextmanager`` generator: ``strategy.run`` enters two of these per
    step, and a class enters and exits in fewer Python calls.
    """

    __slots__ = ("frame", "token")

    def __init__(self, frame: _Frame) -> None:
        self.frame = frame

    def __enter__(self) -> None:
        self.token = _STACK.set(_STACK.get() + (self.frame,))

    def __exit__(self, *exc: object) -> None:
        _STACK.reset(self.token)


def enter_scope(strategy: "Strategy") -> contextlib.AbstractContextManager[None]:
    """Pushes ``strategy``'s cross-replica context; refuses to nest another strategy's scope."""
    top = _top()
    if top is not None and top.strategy is not strategy and not top.strategy._is_default:  # friend: core pair
        raise StrategyScopeError(
            f"Mixing different strategies: cannot enter the scope of {strategy!r} inside the scope of "
            f"{top.strategy!r}.",
            hint="leave the outer `with strategy.scope():` block first; one program uses one strategy",
        )
    if top is not None and top.replica_context is not None and top.strategy is strategy:
        # TF allows scope() in replica context as a no-op; keep the replica context current.
        return contextlib.nullcontext()
    return _push(_Frame(strategy, None))


def enter_replica(strategy: "Strategy", replica_id: int) -> contextlib.AbstractContextManager[None]:
    return _push(_Frame(strategy, ReplicaContext(strategy, replica_id)))


def get_strategy() -> "Strategy":
    """The current strategy: the one whose ``scope()`` or ``run`` we are in, else the default."""
    top = _top()
    return top.strategy if top is not None else _default_strategy()


def has_strategy() -> bool:
    """Whether a strategy other than the default is current."""
    top = _top()
    return top is not None and not top.strategy._is_default  # friend: core pair


def in_cross_replica_context() -> bool:
    """True inside ``scope()`` but outside ``run`` (and inside ``merge_call``'s function)."""
    top = _top()
    return top is not None and top.replica_context is None


def get_replica_context() -> "ReplicaContext | None":
    """The current :class:`ReplicaContext`, or None in cross-replica context.

    Outside any strategy this is the default strategy's replica context, as in TF.
    """
    top = _top()
    if top is None:
        return ReplicaContext(_default_strategy(), 0)
    return top.replica_context


def get_cross_replica_context() -> "Strategy | None":
    """The current strategy in cross-replica context, else None."""
    top = _top()
    return top.strategy if top is not None and top.replica_context is None else None


# The default strategy is defined beside Strategy (phalanx.core.strategy, as TF's distribute_lib does),
# which imports this module: it hands its factory down here when it is imported, so this module,
# the bottom of the core, never imports a strategy.
_default_factory: "Callable[[], Strategy] | None" = None


def set_default_strategy_factory(factory: "Callable[[], Strategy]") -> None:
    """Names the function that returns the default strategy (called by :mod:`phalanx.core.strategy`)."""
    global _default_factory
    _default_factory = factory


def _default_strategy() -> "Strategy":
    if _default_factory is None:  # pragma: no cover - phalanx/__init__ imports phalanx.core.strategy first
        raise RuntimeError("phalanx.core.strategy was not imported; import phalanx first")
    return _default_factory()


class ReplicaContext:
    """The context of one replica inside ``strategy.run``.

    Args:
        strategy: the strategy running the replica.
        replica_id_in_sync_group: this replica's index among all replicas of the job.

    Example::

        def step(x):
            ctx = phalanx.get_replica_context()
            total = ctx.all_reduce(phalanx.ReduceOp.SUM, x.sum())   # same on every replica
            return total
    """

    def __init__(self, strategy: "Strategy", replica_id_in_sync_group: int) -> None:
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group

    @property
    def strategy(self) -> "Strategy":
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        return (str(self._strategy.extended.local_device),)

    def _require_replica_context(self, method: str) -> None:
        """TF's ``require_replica_context``: a replica's collectives only inside ``run``.

        In cross-replica context (``scope()``, ``merge_call``'s function) the other replicas are not
        there to join; TF raises RuntimeError, and ContextError is one.
        """
        if in_cross_replica_context():
            raise ContextError(
                f"ReplicaContext.{method} was called in cross-replica context (inside scope() or merge_call's "
                "function), but it needs replica context.",
                hint=f"call it inside strategy.run; in cross-replica context use strategy.reduce / strategy.gather "
                f"(not {method})",
            )

    def all_reduce(self, reduce_op: Any, value: Any, options: Any = None) -> Any:
        """Reduces ``value`` (a nested structure of tensors) across all replicas; same on each.

        ``options`` is accepted for TF compatibility and has no effect (a warning says so).

        Raises:
            ContextError: called in cross-replica context (TF: RuntimeError).
        """
        self._require_replica_context("all_reduce")
        if options is not None:
            warnings.warn("ReplicaContext.all_reduce(options=...) has no effect in phalanx", UserWarning, stacklevel=2)
        op = ReduceOp.from_any(reduce_op)
        leaves, spec = nest.flatten_with_spec(value)
        tensors = [torch.as_tensor(local_results(v)[0]) for v in leaves]
        ext = self._strategy.extended
        structure = ext.cross_replica.take_structure()  # TF's regroup check of the last run
        with recording(ext.communicator, "all_reduce"):  # the flight recorder: from the caller's line
            if ext.num_processes > 1 and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
                reduced = _AllReduce.apply(ext, op, structure, *tensors)
            else:
                reduced = ext.cross_replica.all_reduce(tensors, op, structure)
        return nest.unflatten(list(reduced), spec)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenates every replica's ``value`` along ``axis``, in replica order (``options``: no effect).

        Raises:
            ContextError: called in cross-replica context (TF: RuntimeError).
        """
        self._require_replica_context("all_gather")
        if options is not None:
            warnings.warn("ReplicaContext.all_gather(options=...) has no effect in phalanx", UserWarning, stacklevel=2)
        ext = self._strategy.extended

        def gather(t: Any) -> torch.Tensor:
            t = torch.as_tensor(local_results(t)[0])
            if ext.num_processes > 1 and torch.is_grad_enabled() and t.requires_grad:
                return _AllGather.apply(ext, axis, t)
            return ext.all_gather(t, axis)

        with recording(ext.communicator, "all_gather"):  # the flight recorder: from the caller's line
            ext.cross_replica.check_structures(ext.cross_replica.take_structure())  # TF's regroup check
            return nest.map_structure(gather, value)

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once in cross-replica context.

        The arguments reach ``merge_fn`` as per-replica values; distributed values in its result
        come back to the replica as this replica's component.
        """
        if not callable(merge_fn):
            raise NotCallableError(merge_fn, what="merge_fn")
        self._require_replica_context("merge_call")
        strategy = self._strategy
        wrapped_args = strategy._wrap_local(args)  # friend: core pair (context and strategy)
        wrapped_kwargs = strategy._wrap_local(kwargs or {})  # friend
        with _push(_Frame(strategy, None)):
            result = merge_fn(strategy, *wrapped_args, **wrapped_kwargs)
        return nest.map_structure(lambda v: v.values[0] if isinstance(v, DistributedValues) else v, result)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


# TF differentiates through the replica context's collectives (ReplicaContext.all_reduce and
# all_gather carry a custom gradient), so a model that all-reduces in its forward pass (global
# statistics, a global loss term) trains. Each backward is itself a collective, run by every
# replica's backward pass in the same order, as the forward ones were.
class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ext: Any, op: ReduceOp, structure: str | None, *tensors: torch.Tensor) -> tuple:
        ctx.ext, ctx.op = ext, op
        return tuple(ext.cross_replica.all_reduce(list(tensors), op, structure))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        # TF: "The gradient of an all-sum is itself an all-sum (all-mean, likewise)."
        return (None, None, None, *ctx.ext.cross_replica.all_reduce(list(grads), ctx.op))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ext: Any, axis: int, tensor: torch.Tensor) -> torch.Tensor:
        gathered = ext.all_gather(tensor, axis)
        ctx.ext, ctx.axis, ctx.length = ext, axis % tensor.dim(), tensor.shape[axis]
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # TF: the gradients of every replica's copy summed, then this replica's slice of them.
        ext = ctx.ext
        (total,) = ext.cross_replica.all_reduce([grad], ReduceOp.SUM)
        lengths = [int(n) for n in ext.all_gather(torch.tensor([ctx.length]), 0)]
        start = sum(lengths[: ext.process_index])
        return None, None, total.narrow(ctx.axis, start, ctx.length)
