"""``phalanx.Variable``: TF's ``tf.Variable`` with its ``aggregation`` and ``synchronization``.

A ``tf.Variable(...)`` ports to ``phalanx.Variable(...)``. Created in a strategy's ``scope()`` it
behaves as TF's ``MirroredVariable`` (``synchronization`` AUTO / ON_WRITE) or ``SyncOnReadVariable``
(ON_READ), with every process holding its replica's copy:

* **ON_WRITE, replica context** (inside ``strategy.run``): ``assign``, ``assign_add`` and
  ``assign_sub`` first combine the replicas' values by ``aggregation`` (SUM, MEAN: one all-reduce of
  this one tensor; ONLY_FIRST_REPLICA: replica 0's value, one broadcast), then apply the result on
  every replica, so the copies stay identical. NONE applies the value when every replica gives the
  same one and raises :class:`AggregationError` (a ValueError) on every replica when they differ
  (TF lets the copies drift apart there). A Python number is TF's "non-distributed value": SUM
  refuses it, as TF does (whether the replicas' numbers agree or not), and MEAN / ONLY_FIRST_REPLICA
  apply it.
* **ON_WRITE, cross-replica context** (``scope()``, outside ``run``, ``merge_call``'s function):
  every process runs the same program, so each applies the update to its own copy.
* **ON_READ** (sync-on-read): updates in replica context stay local (a replica's own count). Reading
  in cross-replica context (``read_value()``, ``value()``, ``numpy()``, ``float()``, arithmetic
  operators, a checkpoint save) combines the replicas' values: SUM, MEAN, ONLY_FIRST_REPLICA
  (replica 0's), NONE raises. ``assign`` in cross-replica context gives each replica
  ``value / num_replicas`` under SUM (so the sum is the value) and ``value`` otherwise;
  ``assign_add`` / ``assign_sub`` there are refused under SUM (as TF refuses them).
* ``strategy.experimental_local_results(v)`` gives this worker's replicas' values;
  ``strategy.reduce(op, v)`` reduces them. Checkpoints store the value read in cross-replica
  context and restore it by a cross-replica ``assign``, so an ON_READ SUM counter keeps its total.

A cross-replica read of an ON_READ variable is a collective (as :meth:`phalanx.Strategy.reduce`):
every replica makes it. Reads and updates of ON_WRITE variables cost nothing extra, and a step
that updates no aggregated variable costs what it did: nothing here runs per step.

A ``Variable`` is a ``torch.nn.Parameter``: torch ops take it as a tensor, an optimizer takes it
(``torch.optim.SGD([v], lr=0.1)``), a module that holds it as an attribute registers it, and a
trainable one created in scope has its gradients summed across replicas like any parameter.
Under a strategy with one replica (``OneDeviceStrategy``, the default strategy) it is a plain
variable.

Example:
    >>> import torch, phalanx as px
    >>> v = px.Variable(1.0, aggregation=px.VariableAggregation.SUM)
    >>> v.assign_add(2.0).numpy(), v.aggregation.name, v.trainable
    (array(3., dtype=float32), 'SUM', True)
    >>> float(v) * 2, v.dtype
    (6.0, torch.float32)
"""

from __future__ import annotations

import copy
import enum
import numbers
import weakref
from typing import Any

import numpy as np
import torch

from phalanx.core import context
from phalanx.errors import PhalanxError
from phalanx.values import DistributedValues, PerReplica, ReduceOp


class VariableAggregation(enum.Enum):
    """How the replicas' updates of a variable are combined (``tf.VariableAggregation``)."""

    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"

    @classmethod
    def from_any(cls, value: Any) -> "VariableAggregation":
        """Accepts a member, its name or value in any case (Keras' ``'sum'``), TF's enum, or None.

        Raises:
            AggregationError: anything else.
        """
        return _enum_from(cls, value, "aggregation")


class VariableSynchronization(enum.Enum):
    """When a distributed variable's copies are brought together (``tf.VariableSynchronization``)."""

    AUTO = "auto"
    NONE = "none"
    ON_WRITE = "on_write"
    ON_READ = "on_read"

    @classmethod
    def from_any(cls, value: Any) -> "VariableSynchronization":
        """Accepts a member, its name or value in any case (Keras' ``'on_read'``), TF's enum, or None (AUTO).

        Raises:
            AggregationError: anything else.
        """
        return _enum_from(cls, value, "synchronization")


def _enum_from(cls: Any, value: Any, what: str) -> Any:
    if isinstance(value, cls):
        return value
    if value is None:
        return cls.AUTO if cls is VariableSynchronization else cls.NONE
    name = getattr(value, "name", value)  # TF's enums and ours, by name
    if isinstance(name, str):
        for member in cls:
            if name.lower() in (member.name.lower(), member.value):
                return member
    raise AggregationError(
        f"Invalid variable {what} {value!r}.",
        hint=f"use one of {', '.join(m.name for m in cls)} (phalanx.{cls.__name__})",
    )


class AggregationError(PhalanxError, ValueError):
    """A variable update or read that its ``aggregation`` / ``synchronization`` cannot give (TF: ValueError).

    Attributes:
        variable: the variable's name, when the error concerns one.
    """

    def __init__(self, message: str, *, variable: str | None = None, hint: str | None = None) -> None:
        self.variable = variable
        super().__init__(message, hint=hint)


# The per-kind update applied to a copy; "assign" replaces, the others add to the value read before.
_KINDS = ("assign", "assign_add", "assign_sub")


class Variable(torch.nn.Parameter, DistributedValues):
    """A variable with ``tf.Variable``'s surface and TF's distributed semantics (module docstring).

    Args:
        initial_value: a tensor, array, number, or a callable returning one.
        trainable: whether gradients update it; default True, False for ON_READ (as TF).
        name: its name (default ``"Variable"``).
        dtype: a torch dtype (or its name, ``"float32"``); default the initial value's.
        aggregation: a :class:`VariableAggregation` (or its name): how replica-context updates combine.
        synchronization: a :class:`VariableSynchronization` (or its name); AUTO means ON_WRITE.

    Raises:
        AggregationError: ``synchronization=NONE`` or MEAN of a non-floating dtype under a strategy
            with several replicas (TF refuses both), or an unknown aggregation / synchronization.

    Inside ``strategy.scope()`` the initial value is broadcast from replica 0 (a collective: every
    replica creates the variable at the same point, as with a parameter). ``phalanx.Variable(...)``
    returns a :class:`SyncOnReadVariable` for ``synchronization=ON_READ``.
    """

    def __new__(
        cls,
        initial_value: Any = None,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        aggregation: Any = VariableAggregation.NONE,
        synchronization: Any = VariableSynchronization.AUTO,
    ) -> "Variable":
        if initial_value is None:
            raise AggregationError("A Variable needs an initial_value.", hint="phalanx.Variable(0.0), as tf.Variable")
        agg = VariableAggregation.from_any(aggregation)
        sync = VariableSynchronization.from_any(synchronization)
        if sync is VariableSynchronization.AUTO:
            sync = VariableSynchronization.ON_WRITE
        if cls is Variable and sync is VariableSynchronization.ON_READ:
            cls = SyncOnReadVariable
        strategy = context.get_strategy() if context.has_strategy() else None
        value = initial_value() if callable(initial_value) else initial_value
        device = strategy.extended.device if strategy is not None else None
        data = _as_tensor(value, _torch_dtype(dtype), device).clone()  # its own memory
        label = name or "Variable"
        if strategy is not None and strategy.num_replicas_in_sync > 1:
            if sync is VariableSynchronization.NONE:
                raise AggregationError(
                    f"`NONE` variable synchronization is not supported under {strategy!r} (variable {label!r}).",
                    variable=label,
                    hint="use ON_WRITE (the default) or ON_READ, as tf.distribute requires",
                )
            if agg is VariableAggregation.MEAN and not (data.is_floating_point() or data.is_complex()):
                raise AggregationError(
                    f"A distributed variable with aggregation=MEAN needs a floating dtype; {label!r} is {data.dtype}.",
                    variable=label,
                    hint="use a floating dtype, or aggregation SUM / ONLY_FIRST_REPLICA",
                )
        if trainable is None:
            trainable = sync is not VariableSynchronization.ON_READ
        requires_grad = bool(trainable) and (data.is_floating_point() or data.is_complex())
        self = super().__new__(cls, data, requires_grad)
        self._name = label
        self._trainable = bool(trainable)
        self._aggregation = agg
        self._synchronization = sync
        self._strategy_ref = weakref.ref(strategy) if strategy is not None else None
        self._shared = False
        if strategy is not None:
            self._join(strategy)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Everything is set in __new__ (a tensor's data is fixed there); DistributedValues.__init__,
        # next in the method order, must not run with these arguments.
        pass

    def _join(self, strategy: Any) -> None:
        """Makes the copies equal (broadcast from replica 0) and, if trainable, their gradients summed."""
        ext = strategy.extended
        before = self.data_ptr()
        # Parameters are synchronised as in scope: broadcast now, gradients summed, found by
        # checkpoints. A strategy that keeps trainable variables in one shared copy moves them there.
        ext.adopt_variables([self])
        self._shared = self.requires_grad and self.data_ptr() != before and strategy.num_replicas_in_sync > 1

    # ---------------------------------------------------------------- TF's properties
    @property
    def name(self) -> str:
        return self._name

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization

    @property
    def distribute_strategy(self) -> Any:
        """The strategy this variable was created under (the current one if none)."""
        strategy = self._strategy_ref() if self._strategy_ref is not None else None
        return strategy if strategy is not None else context.get_strategy()

    @property
    def values(self) -> tuple[Any, ...]:  # DistributedValues: this process's replica component
        return (self,)

    # ---------------------------------------------------------------- reads
    def read_value(self) -> torch.Tensor:
        """The variable's value as a new tensor (a snapshot; gradients flow back to the variable)."""
        return self._read()

    def value(self) -> torch.Tensor:
        """The variable's value as a tensor (TF's ``value()``)."""
        return self._read()

    def numpy(self, *, force: bool = False) -> np.ndarray:
        """The value as a numpy array (on the CPU, detached), as TF's ``numpy()``."""
        return self._read().detach().cpu().numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.numpy()
        return array.astype(dtype) if dtype is not None else array

    def _read(self) -> torch.Tensor:
        return torch.Tensor.clone(self)

    # Python's conversions read the value (combined in cross-replica context for ON_READ), detached.
    def __float__(self) -> float:
        return float(self._read().detach())

    def __int__(self) -> int:
        return int(self._read().detach())

    def __bool__(self) -> bool:
        return bool(self._read().detach())

    # ---------------------------------------------------------------- updates
    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Any:
        """Sets the value (aggregated in replica context; see the module docstring); returns the variable."""
        return self._update("assign", value, read_value)

    def assign_add(
        self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True
    ) -> Any:
        """Adds ``delta`` (aggregated in replica context); returns the variable (None if not ``read_value``)."""
        return self._update("assign_add", delta, read_value)

    def assign_sub(
        self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True
    ) -> Any:
        """Subtracts ``delta`` (aggregated in replica context); returns the variable (None if not ``read_value``)."""
        return self._update("assign_sub", delta, read_value)

    def _update(self, kind: str, value: Any, read_value: bool) -> Any:
        strategy = self._distributed_strategy()
        if strategy is None:
            self._apply(kind, self._operand(value))
        elif in_replica_context_of(strategy):
            self._update_replica(kind, value, strategy)
        else:
            self._update_cross_replica(kind, value, strategy)
        return self if read_value else None

    def _distributed_strategy(self) -> Any:
        """The strategy whose replicas hold copies of this variable, if it has several; else None."""
        strategy = self._strategy_ref() if self._strategy_ref is not None else None
        return strategy if strategy is not None and strategy.num_replicas_in_sync > 1 else None

    def _operand(self, value: Any) -> torch.Tensor:
        if isinstance(value, Variable):
            value = value._read()
        t = _as_tensor(value, self.dtype, self.device)
        if t.shape != self.shape:
            raise AggregationError(
                f"Cannot update variable {self._name!r} of shape {tuple(self.shape)} with a value of shape "
                f"{tuple(t.shape)}.",
                variable=self._name,
                hint="give a value of the variable's shape, as tf.Variable requires",
            )
        return t

    def _apply(self, kind: str, t: torch.Tensor, old: torch.Tensor | None = None) -> None:
        """Writes the update. ``old``: the value read before a collective (see :meth:`_update_replica`)."""
        with torch.no_grad():
            if kind == "assign":
                self.data.copy_(t)
            elif old is not None:
                self.data.copy_(old + t if kind == "assign_add" else old - t)
            elif kind == "assign_add":
                self.data.add_(t)
            else:
                self.data.sub_(t)

    def _update_replica(self, kind: str, value: Any, strategy: Any) -> None:
        t = self._operand(value)
        # The value before the update is read before the collective and every replica writes
        # old + delta: under a strategy that keeps the variable in one shared copy, all write the
        # same bytes, and nobody has written before everybody has read.
        old = None if kind == "assign" else self.detach().clone()
        if self._shared:
            strategy.extended.barrier()  # a zero Python number under SUM has no collective: wait here
        t = aggregate_update(strategy.extended, self._aggregation, t, python_value=value, name=self._name)
        self._apply(kind, t.to(self.dtype), old)

    def _update_cross_replica(self, kind: str, value: Any, strategy: Any) -> None:
        t = self._operand(value)
        if self._shared:
            # One copy shared by every process: read it, wait until everyone has (and has made every
            # read the program made before this update: TF's program order), then all write the
            # same value.
            old = None if kind == "assign" else self.detach().clone()
            strategy.extended.barrier()
            self._apply(kind, t, old)
        else:
            self._apply(kind, t)

    # ---------------------------------------------------------------- checkpoints
    # The protocol of phalanx.checkpoint.sharded_variables: a checkpoint stores one full tensor, read on
    # every process during save, and gives it back through a cross-replica assign.
    def _phalanx_full_tensor_(self) -> torch.Tensor:
        return self._read().detach()

    def _phalanx_assign_full_(self, tensor: torch.Tensor) -> None:
        self.assign(tensor.to(self.device), read_value=False)

    def _phalanx_layout_(self) -> dict:
        return {"aggregation": self._aggregation.name, "synchronization": self._synchronization.name}

    # ---------------------------------------------------------------- python protocol
    def __deepcopy__(self, memo: dict) -> "Variable":
        if id(self) in memo:
            return memo[id(self)]
        # A copy of an already synchronised variable: the same value everywhere, no collective.
        result = _without_strategy(type(self), self.data.clone(), self.requires_grad, self.__dict__)
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled (torch.save of an object holding it) as a variable of no strategy: unpickling
        # is local, with no collective.
        state = {k: v for k, v in self.__dict__.items() if k != "_strategy_ref"}
        return (_without_strategy, (type(self), self.detach().cpu(), self.requires_grad, state))

    def __repr__(self) -> str:
        return (
            f"<phalanx.{type(self).__name__} {self._name!r} shape={tuple(self.shape)} dtype={self.dtype}, "
            f"{self._repr_value()}>"
        )

    def _repr_value(self) -> str:
        return f"numpy={self.detach().cpu().numpy()!r}"

    __str__ = __repr__

    def __hash__(self) -> int:
        return id(self)


class SyncOnReadVariable(Variable, PerReplica):
    """An ON_READ variable: each replica updates its own copy; cross-replica reads combine them.

    Made by ``phalanx.Variable(..., synchronization=ON_READ)`` (module docstring). Python's
    operators (``v + 1``, ``float(v)``) read it as :meth:`read_value` does; torch functions
    (``torch.add(v, 1)``) see this replica's copy.
    """

    def _join(self, strategy: Any) -> None:
        # Equal to start with, then each replica's own: no gradient summing, and no parameter
        # fingerprint, which would take the replicas' legitimately different values for drift.
        strategy.extended.broadcast([self.data], 0)

    def _read(self) -> torch.Tensor:
        strategy = self._distributed_strategy()
        if strategy is None or in_replica_context_of(strategy):
            return torch.Tensor.clone(self)
        return self._read_across(strategy)

    def _read_across(self, strategy: Any) -> torch.Tensor:
        return combine_across_replicas(strategy.extended, self._aggregation, self.detach().clone(), name=self._name)

    def _update_replica(self, kind: str, value: Any, strategy: Any) -> None:
        self._apply(kind, self._operand(value))

    def _update_cross_replica(self, kind: str, value: Any, strategy: Any) -> None:
        t = on_read_cross_replica_operand(kind, self._aggregation, self._operand(value), strategy, name=self._name)
        self._apply(kind, t)

    def _phalanx_full_tensor_(self) -> torch.Tensor:
        strategy = self._distributed_strategy()
        if strategy is not None and self._aggregation is VariableAggregation.NONE:
            local = self.detach().clone()  # NONE cannot be combined: the checkpoint holds replica 0's
            strategy.extended.broadcast([local], 0)
            return local
        return self._read().detach()

    def _repr_value(self) -> str:
        # No collective here: a repr may be asked for on one replica only (a log line, a debugger).
        return f"this replica's value={self.detach().cpu().numpy()!r}"


def _operator(name: str) -> Any:
    def op(self: SyncOnReadVariable, *args: Any) -> Any:
        return getattr(self._read(), name)(*args)

    op.__name__ = name
    return op


for _name in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__pow__",
    "__rpow__",
    "__matmul__",
    "__rmatmul__",
    "__neg__",
    "__abs__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
):
    setattr(SyncOnReadVariable, _name, _operator(_name))
del _name


# --------------------------------------------------------------------------- the rules, shared with phalanx.keras
def aggregate_update(
    extended: Any, aggregation: VariableAggregation, value: torch.Tensor, *, python_value: Any = None, name: str = ""
) -> torch.Tensor:
    """What every replica applies for an ON_WRITE update made in replica context (TF's MirroredVariable).

    Collective (except for a zero Python number under SUM): every replica calls it with its own value.

    Args:
        extended: the strategy's ``extended``.
        aggregation: the variable's aggregation.
        value: this replica's value (or delta), of the variable's dtype and shape.
        python_value: the value as given, if it was a Python number: TF's non-distributed value, so
            MEAN gives it and SUM refuses it (zero excepted), saying whether the replicas' numbers
            agreed (one more collective, on that error path only).
        name: the variable's name, for errors.

    Raises:
        AggregationError: NONE with values that differ between replicas (on every replica), or SUM of a
            Python number.
    """
    if aggregation is VariableAggregation.NONE:
        return _agree(extended, value, name)
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        first = value.clone()
        extended.broadcast([first], 0)
        return first
    number = isinstance(python_value, numbers.Number) and not isinstance(python_value, bool)
    if number and aggregation is VariableAggregation.SUM and python_value != 0:
        # TF refuses a Python number here whether the replicas' numbers agree (ValueError: a
        # non-DistributedValues value cannot be SUM-reduced) or not (TF 2.21 fails inside its
        # all-reduce). Which it is decides the message: one collective, on the error path only.
        first = value.clone()
        extended.broadcast([first], 0)
        differ = torch.zeros(1, dtype=torch.int64, device=value.device) + int(not bool((first == value).all()))
        if int(extended.all_reduce([differ], ReduceOp.SUM)[0]) > 0:
            raise AggregationError(
                f"Python numbers that differ between replicas (this replica's: {python_value!r}) cannot be "
                f"SUM-aggregated into variable {name!r}: a Python number is not a per-replica value, and TF "
                "refuses to sum one (TF 2.21 fails inside its all-reduce: 'float' object has no attribute 'device').",
                variable=name,
                hint="give each replica's value as a tensor (torch.tensor(...)): tensors are summed",
            )
        raise AggregationError(
            f"A value that is not per-replica ({python_value!r}) cannot be SUM-aggregated into variable "
            f"{name!r}: every replica gave the same Python number, which TF takes as one value for all "
            "replicas and refuses to sum (ValueError: a non-DistributedValues value cannot be reduced).",
            variable=name,
            hint="give a tensor computed by the replica (torch.tensor(...)), or aggregation=MEAN",
        )
    # A number under MEAN is still averaged: each replica runs its own Python, so a number computed
    # from the replica (float(rank)) may differ; the mean of equal numbers is the number (TF's).
    op = ReduceOp.SUM if aggregation is VariableAggregation.SUM else ReduceOp.MEAN
    return extended.all_reduce([value], op)[0].to(value.dtype)


def _agree(extended: Any, value: torch.Tensor, name: str) -> torch.Tensor:
    """NONE in replica context: replica 0's value if every replica gives it; else raises on every replica."""
    first = value.clone()
    extended.broadcast([first], 0)
    same = (first == value) | (first != first) & (value != value) if value.is_floating_point() else first == value
    differ = torch.zeros(1, dtype=torch.int64, device=value.device) + int(not bool(same.all()))
    if int(extended.all_reduce([differ], ReduceOp.SUM)[0]) > 0:  # the same verdict on every replica
        raise AggregationError(
            f"The replicas updated variable {name!r} (aggregation NONE) with different values in replica "
            "context, so its copies would drift apart.",
            variable=name,
            hint="create it with aggregation SUM, MEAN or ONLY_FIRST_REPLICA (phalanx.VariableAggregation, or "
            "Keras' 'sum' / 'mean' / 'only_first_replica'), or update it in cross-replica context "
            "(outside strategy.run, or in merge_call's function)",
        )
    return first


def combine_across_replicas(
    extended: Any, aggregation: VariableAggregation, local: torch.Tensor, *, name: str = ""
) -> torch.Tensor:
    """An ON_READ variable's value read in cross-replica context (TF's SyncOnReadVariable). Collective.

    Raises:
        AggregationError: aggregation NONE (TF: ValueError).
    """
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        first = local.clone()
        extended.broadcast([first], 0)
        return first
    if aggregation is VariableAggregation.NONE:
        raise AggregationError(
            f"The sync-on-read variable {name!r} has aggregation NONE, so its replicas' values cannot be "
            "combined when it is read in cross-replica context.",
            variable=name,
            hint="create it with aggregation SUM, MEAN or ONLY_FIRST_REPLICA, or read it inside strategy.run",
        )
    op = ReduceOp.SUM if aggregation is VariableAggregation.SUM else ReduceOp.MEAN
    return extended.all_reduce([local], op)[0].to(local.dtype)


def on_read_cross_replica_operand(
    kind: str, aggregation: VariableAggregation, value: torch.Tensor, strategy: Any, *, name: str = ""
) -> torch.Tensor:
    """What each replica applies for an ON_READ update made in cross-replica context (TF's rule).

    ``assign`` under SUM gives each replica ``value / num_replicas`` (the sum read back is the value);
    ``assign_add`` / ``assign_sub`` under SUM are refused.

    Raises:
        AggregationError: ``assign_add`` / ``assign_sub`` under SUM.
    """
    if aggregation is not VariableAggregation.SUM:
        return value
    if kind != "assign":
        raise AggregationError(
            f"A sync-on-read variable with aggregation SUM ({name!r}) does not support `{kind}` in "
            "cross-replica context.",
            variable=name,
            hint="update it inside strategy.run, or assign the new total",
        )
    quotient = value / strategy.num_replicas_in_sync
    return quotient.to(value.dtype) if value.dtype.is_floating_point else quotient.trunc().to(value.dtype)


def in_replica_context_of(strategy: Any) -> bool:
    """Whether code runs inside ``strategy.run`` (not in its ``merge_call`` function, nor another strategy's)."""
    replica = context.get_replica_context()
    return replica is not None and replica.strategy is strategy


def _torch_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = getattr(dtype, "name", None) or str(np.dtype(dtype))
    found = getattr(torch, str(name), None)
    if not isinstance(found, torch.dtype):
        raise AggregationError(f"Unknown dtype {dtype!r} for a Variable.", hint="use a torch dtype, e.g. torch.float32")
    return found


def _as_tensor(value: Any, dtype: torch.dtype | None, device: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        t = t.to(dtype=dtype or t.dtype, device=device if device is not None else t.device)
    else:
        t = torch.as_tensor(np.asarray(value) if not isinstance(value, numbers.Number) else value, dtype=dtype)
        if device is not None:
            t = t.to(device)
    return t


def _without_strategy(cls: type, data: torch.Tensor, requires_grad: bool, state: dict) -> Variable:
    """A variable of ``cls`` holding ``data``, with ``state``'s attributes, synchronised by nobody new."""
    result = torch.nn.Parameter.__new__(cls, data, requires_grad)
    result.__dict__.update(copy.copy(state))
    result.__dict__.setdefault("_strategy_ref", None)
    result.__dict__.setdefault("_shared", False)
    return result
