"""The Strategy API shared by every strategy (``tf.distribute.Strategy``).

A strategy is a thin object over a :class:`~phalanx.core.extended.StrategyExtended`
(``core/extended.py``), which owns the machinery: the communicator, the replica's device, the
captured variables and their gradient synchronisation. Concrete strategies
(``phalanx/strategies/``) only choose how these are put together. Also here: the default strategy
and the strategies this process built (for process identity); the extension points the core
calls live in :mod:`phalanx.core.extension_points`.

In phalanx each replica is a process (see docs/ARCHITECTURE.md): ``run`` calls the function once, on this
process's replica; ``reduce`` and ``gather`` are collectives whose result every process gets.

Example:
    >>> import torch, phalanx as px
    >>> strategy = px.OneDeviceStrategy("/cpu:0")
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(4, 1)
    >>> out = strategy.run(lambda x: model(x).sum(), args=(torch.ones(2, 4),))
    >>> strategy.reduce("SUM", out, axis=None).shape
    torch.Size([])
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from phalanx import nest
from phalanx.comm.communicator import LocalCommunicator
from phalanx.comm.flight_recorder import recording
from phalanx.core import compiled, context, hazards, integrations
from phalanx.core.extended import (
    StrategyExtended,
    _count_dtype,
    _detached,
    _ignored,
    _is_integer,
    tf_device_name,
)
from phalanx.core.extension_points import (
    _SCOPE_ENTER_HOOKS,
    RUN_ARGUMENT_OBSERVERS,
    RUN_OBSERVERS,
    _device_contexts,
)
from phalanx.devices import LogicalDevice
from phalanx.errors import (
    ContextError,
    NotCallableError,
)
from phalanx.interactive import step_hook as _interactive
from phalanx.values import DistributedValues, PerReplica, ReduceOp, local_results, mean_dtype

# The strategies this process built, oldest first (weak: a strategy nobody holds is gone).
_LIVE: list[weakref.ref] = []
_LIVE_LOCK = threading.Lock()


def live_strategy() -> "Strategy | None":
    """The strategy this process built last and has not closed, if any."""
    live = live_strategies()
    return live[0] if live else None


def live_strategies() -> "list[Strategy]":
    """The strategies this process built and has not closed, the newest first (for process identity)."""
    with _LIVE_LOCK:
        found = [ref() for ref in reversed(_LIVE)]
    return [s for s in found if s is not None and not s._closed]


def _spans_processes() -> bool:
    """Whether a strategy this process built and has not closed spans several processes."""
    return any(getattr(s.extended, "num_processes", 1) > 1 for s in live_strategies())


class Strategy:
    """Base class of all strategies; see the module docstring for the execution model."""

    _is_default = False

    def __init__(self, extended: StrategyExtended, cluster_resolver: Any = None) -> None:
        self._extended = extended
        self._cluster_resolver = cluster_resolver
        self._closed = False
        extended._container_strategy_ref = weakref.ref(self)
        if not self._is_default:
            with _LIVE_LOCK:
                _LIVE[:] = [r for r in _LIVE if r() is not None] + [weakref.ref(self)]
            if getattr(extended, "num_processes", 1) > 1:
                hazards.install(_spans_processes)  # lines every replica runs that race (os.makedirs), input()

    # ---------------------------------------------------------------- properties
    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas of the whole job (all processes, all hosts)."""
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self) -> Any:
        return self._cluster_resolver

    # ---------------------------------------------------------------- contexts
    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Makes this strategy current; parameters created inside are distributed by it.

        Raises:
            StrategyScopeError: another strategy's scope is already open.
        """
        integrations.activate_loaded()  # tf.keras needs no extra import; neither does Keras here
        for hook in _SCOPE_ENTER_HOOKS:
            hook(self)
        with context.enter_scope(self), _device_contexts(self):
            with self._extended.variable_sync.scope(self):
                yield self
            if context.in_cross_replica_context():
                self._extended.sync_variables()

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, options: Any = None) -> Any:
        """Runs ``fn`` on this process's replica and returns its result as per-replica values.

        Args:
            fn: the replica function, e.g. one training step.
            args, kwargs: its arguments; distributed values are replaced by this replica's part.
            options: accepted for TF compatibility; has no effect (a warning says so).

        Raises:
            NotCallableError: ``fn`` is not callable.
            ContextError: called inside another ``run`` (replica context), as TF refuses it: it would
                start a nested step. Inside ``merge_call``'s function (cross-replica) it may be called.
        """
        if not callable(fn):
            raise NotCallableError(fn)
        if context.get_replica_context() is not None and context.has_strategy():
            raise ContextError(
                "strategy.run was called inside strategy.run (in replica context); TensorFlow refuses it too.",
                hint="call the inner function directly, or use get_replica_context().merge_call(fn) to run "
                "code in cross-replica context",
            )
        if options is not None:
            _ignored("Strategy.run", "options")
        fn = compiled.replica_function(fn)  # compiled inside a @phalanx.function step
        if not isinstance(args, (tuple, list)):
            args = (args,)
        _interactive.before_step()  # an interrupted notebook stops every replica at the same step
        for observe in RUN_OBSERVERS:
            observe(self, fn)
        for observe_arguments in RUN_ARGUMENT_OBSERVERS:
            observe_arguments(self, args, kwargs or {})
        result = self._extended.call_for_each_replica(fn, args, kwargs)
        return self._wrap_local(result)

    def experimental_run_v2(
        self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, options: Any = None
    ) -> Any:
        """TF 2.0's name for :meth:`run`."""
        return self.run(fn, args, kwargs, options)

    # ---------------------------------------------------------------- values
    def _wrap_local(self, structure: Any) -> Any:
        if self.num_replicas_in_sync == 1:
            return structure
        # The repr of a PerReplica then says which replica it holds and of how many.
        ids, n = (getattr(self._extended, "replica_id", 0),), self.num_replicas_in_sync
        return nest.map_structure(
            lambda v: (
                v
                if isinstance(v, DistributedValues) or v is None
                else PerReplica((v,), replica_ids=ids, num_replicas=n)
            ),
            structure,
        )

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of this worker's replicas, in replica order (``tf.distribute``'s definition).

        A worker is a host of a single-host strategy, or one task of a multi-worker cluster; in
        TF its replicas share one process. Here each replica is a process, so a per-replica
        value's components on the other processes of this worker are gathered: with
        ``MirroredStrategy`` over N devices every process gets all N values (the input
        tutorial's recipe that puts predictions back in order sees every row). This is a
        collective when the worker has more than one replica: call it on every replica, as
        :meth:`reduce`. Mirrored values give N identical entries; other values ``(value,)``.
        """
        with recording(self._extended.communicator, "gather"):
            return self._local_results(value)

    def _local_results(self, value: Any) -> tuple[Any, ...]:
        leaves, spec = nest.flatten_with_spec(value)
        ext, values = self._extended, self._extended.cross_replica
        if ext.num_processes // max(ext.input_sharding.num_workers, 1) > 1:  # a collective here
            values.check_structures(values.take_structure())  # TF's regroup check
        if not leaves:
            return (value,)
        # Results of a replica's computation are values, as on several replicas of a host (gathered
        # copies there), not the replica's autograd graph; variables stay themselves.
        per_leaf = [tuple(map(_detached, values.local_results(v))) for v in leaves]
        count = max(len(p) for p in per_leaf)
        per_leaf = [p if len(p) == count else p * count for p in per_leaf]
        return tuple(nest.unflatten([p[i] for p in per_leaf], spec) for i in range(count))

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """Combines a per-replica value across all replicas (a collective: call it everywhere).

        Args:
            reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN`` (or their names).
            value: per-replica values (e.g. returned by :meth:`run`), possibly nested.
            axis: also reduce along this axis of each replica's value; with MEAN the result is
                the mean over all elements of all replicas (correct for uneven batches).

        Returns:
            The reduced value, the same on every process: tensors detached from the autograd graph
            (with one replica as with several; TF's result is outside the gradient tape too), so
            ``float(strategy.reduce(...))`` needs no ``.detach()``.

        Raises:
            ReduceOpError: unknown ``reduce_op``.
            ContextError: called in replica context (TF: RuntimeError).
            NonDistributedValueError: SUM of a plain tensor across the replicas of one worker (TF's
                ValueError); MEAN returns it, and over several workers it is reduced across them.
            RunStructureMismatchError: the replicas' last ``run`` returned different structures.
        """
        op = ReduceOp.from_any(reduce_op)
        if context.get_replica_context() is not None and context.has_strategy():
            raise ContextError(
                "strategy.reduce is a cross-replica API and was called inside strategy.run.",
                hint="use phalanx.get_replica_context().all_reduce(...) in replica context",
            )
        with recording(self._extended.communicator, "reduce"):
            return self._reduce(op, value, axis)

    def _reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        leaves, spec = nest.flatten_with_spec(value)
        values = self._extended.cross_replica
        structure = values.take_structure()  # TF's regroup check rides on this collective
        if axis is None:
            results = values.reduce(op, leaves, structure)
        else:
            # TF reduces along `axis` inside `run` first, so every value is then per-replica, a plain
            # tensor too (SUM over N replicas counts it N times, as TF's does).
            tensors = [torch.as_tensor(local_results(leaf)[0]) for leaf in leaves]
            # Counts travel in the values' message where that dtype holds them exactly.
            counts = [torch.tensor(float(t.shape[axis]), dtype=_count_dtype(t.dtype), device=t.device) for t in tensors]
            # An integer sum keeps its dtype, as TF's reduce_sum (torch's sum would widen it to int64).
            tensors = [t.sum(dim=axis, dtype=t.dtype if _is_integer(t.dtype) else None) for t in tensors]
            if op is ReduceOp.SUM:
                results = values.all_reduce(tensors, op, structure)
            else:
                # Sum the values and the element counts, then divide: exact for uneven replicas.
                sums = values.all_reduce(tensors + counts, ReduceOp.SUM, structure)
                k = len(tensors)
                results = [
                    (s / c).to(s.dtype if s.is_floating_point() else mean_dtype(s.dtype))
                    for s, c in zip(sums[:k], sums[k:])
                ]
        # Several replicas' results come out of a collective, detached; one replica's must not be
        # the loss it was given, still attached to its graph.
        return nest.unflatten([t.detach() for t in results], spec)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's value along ``axis`` (a collective); same on every process.

        The result is detached from the autograd graph, with one replica as with several (see
        :meth:`reduce`); ``ReplicaContext.all_gather`` is the one inside ``run``. A plain tensor is
        one value per worker, as in TF: on one worker the result is the tensor itself; over several
        workers, the workers' tensors concatenated.

        Raises:
            ContextError: called in replica context (TF: RuntimeError).
            RunStructureMismatchError: the replicas' last ``run`` returned different structures.
        """
        if context.get_replica_context() is not None and context.has_strategy():
            raise ContextError(
                "strategy.gather is a cross-replica API and was called inside strategy.run.",
                hint="use phalanx.get_replica_context().all_gather(value, axis)",
            )
        with recording(self._extended.communicator, "gather"):
            return self._gather(value, axis)

    def _gather(self, value: Any, axis: int) -> Any:
        ext, values = self._extended, self._extended.cross_replica
        values.check_structures(values.take_structure())  # TF's regroup check
        workers = max(ext.input_sharding.num_workers, 1)
        per_worker = ext.num_processes // workers

        def gather_leaf(v: Any) -> torch.Tensor:
            if isinstance(v, DistributedValues) or ext.num_processes == 1:
                return values.all_gather(v, axis).detach()
            # A plain tensor is one value per worker (TF): itself on one worker, else the workers' values.
            if workers == 1:
                return torch.as_tensor(v)
            everyone = values.all_gather_list(torch.as_tensor(v).movedim(axis, 0))
            return torch.cat(everyone[::per_worker], dim=0).movedim(0, axis)

        return nest.map_structure(gather_leaf, value)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """Calls ``value_fn(ValueContext)`` for this process's replica and wraps the result."""
        from phalanx.input.input_context import ValueContext

        if not callable(value_fn):
            raise NotCallableError(value_fn, what="value_fn")
        rank = self._extended.process_index
        return self._wrap_local(value_fn(ValueContext(rank, self.num_replicas_in_sync)))

    # ---------------------------------------------------------------- input
    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> Any:
        """Splits each global batch of ``dataset`` across the replicas; see :mod:`phalanx.input`."""
        from phalanx.input.distributed_dataset import DistributedDataset

        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None) -> Any:
        """Builds input pipelines with ``dataset_fn(InputContext)``, one per worker as TF does (or one per
        replica with ``InputReplicationMode.PER_REPLICA``); see :mod:`phalanx.input`."""
        from phalanx.input.distributed_dataset import DatasetFromFunction

        if not callable(dataset_fn):
            raise NotCallableError(dataset_fn, what="dataset_fn")
        return DatasetFromFunction(self, dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Releases the communicator (also done at interpreter exit)."""
        self._closed = True
        self._extended._close()
        launcher = getattr(self._extended, "_launcher", None)  # friend: SyncExtended's launcher, if any
        if launcher is not None and hasattr(launcher, "strategy_closed"):
            launcher.strategy_closed(self._extended)  # an interactive session ends with its last strategy

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"


class DefaultStrategy(Strategy):
    """One replica on the current device; ``scope()`` does not capture variables (as in TF).

    Defined here, beside :class:`Strategy`, as TF defines its default strategy in
    ``distribute_lib``: the context stack (:mod:`phalanx.core.context`) needs it and must not import
    a module of concrete strategies.
    """

    _is_default = True

    def __init__(self) -> None:
        device = (
            LogicalDevice("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else LogicalDevice("cpu", 0)
        )
        name = (tf_device_name(device),)
        super().__init__(StrategyExtended(LocalCommunicator(), device, name, name))

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Mostly a no-op, as TF's: the default replica context stays current (not cross-replica)."""
        if context.has_strategy():  # inside another strategy's scope: keep its contexts (TF too)
            yield self
            return
        with context.enter_replica(self, 0):
            yield self


@functools.lru_cache(maxsize=1)
def default_strategy() -> DefaultStrategy:
    """The default strategy of this process (stateless apart from its device, so one is enough)."""
    return DefaultStrategy()


context.set_default_strategy_factory(default_strategy)


def close_at_exit(owner: Any) -> None:
    """Calls ``owner``'s close when the interpreter exits, unless ``owner`` is gone by then.

    Every strategy that starts machinery calls it once (``SyncExtended``, the parameter-server
    strategy); it lives beside :class:`Strategy` so both wings reach it downward.
    ``owner`` is a Strategy, or a StrategyExtended (whose strategy's ``close`` is called if it
    still exists, so that the strategy counts as closed).
    """
    ref = weakref.ref(owner)

    def _close() -> None:
        o = ref()
        if o is None:
            return
        strategy = o.container_strategy if isinstance(o, StrategyExtended) else o
        if strategy is not None:
            strategy.close()
        else:
            o._close()

    atexit.register(_close)
