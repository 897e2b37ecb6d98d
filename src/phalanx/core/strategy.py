"""The Strategy API shared by every strategy (``tf.distribute.Strategy``).

A strategy is a thin object over a :class:`StrategyExtended`, which owns the machinery: the
communicator, the replica's device, the captured variables and their gradient synchronisation.
Concrete strategies (``phalanx/strategies/``) only choose how these are put together.

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
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch

from phalanx import nest
from phalanx.comm.communicator import Communicator, LocalCommunicator
from phalanx.comm.cross_device_ops import CrossDeviceOps, NcclAllReduce
from phalanx.comm.flight_recorder import recording
from phalanx.comm.guard import ReplicaGuard
from phalanx.comm.reducer import DEFAULT_BUCKET_BYTES
from phalanx.core import compiled, context, hazards, integrations
from phalanx.core.consistency import ConsistencyChecks
from phalanx.core.cross_replica import CrossReplicaValues
from phalanx.core.gradient_sync import AllReduce, GradientSync
from phalanx.core.job_stats import JobStats
from phalanx.core.losses import loss_scale_watch
from phalanx.core.variable_sync import VariableSync
from phalanx.devices import LogicalDevice
from phalanx.errors import (
    ContextError,
    NotCallableError,
)
from phalanx.input import global_batch
from phalanx.interactive import hooks as _interactive
from phalanx.values import DistributedValues, PerReplica, ReduceOp, local_results, mean_dtype

# Called as ``observe(strategy, fn)`` before each ``run``; phalanx.keras adds one for metrics.
RUN_OBSERVERS: list[Callable[[Any, Callable[..., Any]], None]] = []
# Called as ``observe(strategy, args, kwargs)`` before each ``run`` with what ``fn`` is given
# (phalanx.keras adapts a Keras optimizer passed to the step function, as it does one ``fn`` names).
RUN_ARGUMENT_OBSERVERS: list[Callable[[Any, tuple, dict], None]] = []


def tf_device_name(device: LogicalDevice, task: str = "/job:localhost/replica:0/task:0") -> str:
    """TF's full name of ``device`` on ``task``, e.g. ``/job:localhost/replica:0/task:0/device:CPU:1``."""
    kind = "GPU" if device.type == "cuda" else device.type.upper()
    return f"{task}/device:{kind}:{device.index}"


@dataclass(frozen=True)
class InputSharding:
    """How this process's input relates to the other workers' (read by :mod:`phalanx.input`).

    Attributes:
        num_workers: the hosts (workers) that read input; each auto-shards its dataset by this.
        worker_index: this process's worker among them.
        agree_on_end: processes may hold inputs of different lengths, so every step they agree
            on who still has data (multi-worker), and all stop at the same step.
    """

    num_workers: int = 1
    worker_index: int = 0
    agree_on_end: bool = False


@runtime_checkable
class CheckpointParticipant(Protocol):
    """A strategy whose state lives away from the user's objects takes part in saves and restores.

    :class:`phalanx.checkpoint.Checkpoint` asks the ``extended`` of the strategy that owns an
    object: the parameter servers' strategy gathers their optimizer state for a save and sends
    it back after a restore; the sharded strategy reads each replica's shards for a restore (its
    saves need nothing: a checkpoint writes DTensors shard by shard). The base
    :class:`StrategyExtended` implements them as no-ops.
    """

    def state_to_save(self, obj: Any) -> Any:
        """The state of ``obj`` to store, or None for ``obj.state_dict()``."""

    def after_restore(self, obj: Any) -> None:
        """Called after a checkpoint restored ``obj`` in place."""

    def state_to_restore(self, obj: Any, saved: Any) -> Any:
        """``saved`` in the form ``obj.load_state_dict`` takes (a sharded strategy cuts it to its shard)."""


class StrategyExtended:
    """The machinery behind a strategy (``tf.distribute.StrategyExtended``).

    Its public members are the contract the rest of phalanx (input, checkpoints, Keras, the
    coordinator) and user code rely on; the work is done by the collaborators it holds:
    ``variable_sync`` (:class:`~phalanx.core.variable_sync.VariableSync`: the variables created under
    the strategy), ``cross_replica`` (:class:`~phalanx.core.cross_replica.CrossReplicaValues`:
    collectives on values) and ``consistency`` (:class:`~phalanx.core.consistency.ConsistencyChecks`:
    the guard). The ``_`` methods are what a strategy overrides besides the checkpoint
    protocol: how its gradients are synchronised, what it settles around a step. Collectives
    (``all_reduce``, ``broadcast``, ``all_gather``, ``barrier``) must be called by every process of
    the job at the same point.

    Args:
        comm: the communicator among all replicas of the job.
        local_device: the device of this process's replica.
        worker_devices: every device the strategy computes on (TF names).
        parameter_devices: where variables live (TF names).
        cross_device_ops: how gradients are summed.
        bucket_bytes: gradient bucket size (``bytes_per_pack``).
        input_sharding: how this process's input relates to the other workers'.
    """

    def __init__(
        self,
        comm: Communicator,
        local_device: LogicalDevice,
        worker_devices: tuple[str, ...],
        parameter_devices: tuple[str, ...],
        cross_device_ops: CrossDeviceOps | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        input_sharding: InputSharding | None = None,
    ) -> None:
        self._comm, self._local_device = comm, local_device
        self._worker_devices, self._parameter_devices = worker_devices, parameter_devices
        self._cross_device_ops = cross_device_ops or NcclAllReduce()
        self._bucket_bytes = bucket_bytes
        self._input_sharding = sharding = input_sharding or InputSharding()
        self._step = 0
        self.stats = JobStats()  # steps, samples and time, for the job report (phalanx.report)
        self._container_strategy_ref: Any = None
        # Whether gradients, guard, extended.all_reduce and barriers go through the communicator:
        # with several replicas, or with one whose process group was built anyway
        # (PHALANX_SINGLE_REPLICA_COLLECTIVES=1: one GPU runs the real NCCL path, as DDP does).
        self._collectives = comm.world_size > 1 or not isinstance(comm, LocalCommunicator)
        step = lambda: self._step  # noqa: E731
        self.consistency = ConsistencyChecks(comm, step, self._synchronised, self._collectives)
        self.cross_replica = CrossReplicaValues(
            comm, self.device, self.consistency, sharding.num_workers, sharding.worker_index, step, self._collectives
        )
        self.variable_sync = VariableSync(
            self,
            comm,
            self.device,
            self.cross_replica.broadcast,
            self.consistency.mark_changed,
            self._sync_new_variables,
            self._module_synchronized_elsewhere,
            step,
        )
        #: How this strategy's gradients are synchronised (see :mod:`phalanx.core.gradient_sync`).
        self.gradient_sync: GradientSync = self._make_gradient_sync()

    # ---------------------------------------------------------------- TF's properties
    @property
    def worker_devices(self) -> tuple[str, ...]:
        return self._worker_devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return self._parameter_devices

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints (the chief only)."""
        return self._comm.rank == 0

    @property
    def should_save_summary(self) -> bool:
        return self._comm.rank == 0

    @property
    def should_init(self) -> bool:
        return True

    experimental_should_init = should_init

    @property
    def experimental_between_graph(self) -> bool:
        return self._comm.world_size > 1

    @property
    def experimental_require_static_shapes(self) -> bool:
        return False

    # ---------------------------------------------------------------- the contract: identity
    @property
    def process_index(self) -> int:
        """This process's index among the job's synchronous processes (0 is the chief)."""
        return self._comm.rank

    replica_id = process_index  # one replica per process: the replica's id in the sync group

    @property
    def num_processes(self) -> int:
        """The number of processes taking part in this strategy's collectives."""
        return self._comm.world_size

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas of the whole job (one per process)."""
        return self._comm.world_size

    @property
    def device(self) -> torch.device:
        """This replica's torch device (``cpu`` for every logical CPU replica)."""
        return self._local_device.torch_device

    _torch_device = device

    @property
    def local_device(self) -> LogicalDevice:
        """This replica's logical device (``cpu:1`` for the second CPU replica of a host)."""
        return self._local_device

    @property
    def step(self) -> int:
        """How many times ``strategy.run`` was called (the step the job is at)."""
        return self._step

    @property
    def is_asynchronous(self) -> bool:
        """Whether workers train independently (parameter servers) rather than in lockstep."""
        return False

    @property
    def communicator(self) -> Communicator:
        """The communicator behind the collectives (:mod:`phalanx.comm`), for tools and benchmarks."""
        return self._comm

    @property
    def consistency_checks(self) -> int:
        """How many collectives the consistency guard has checked so far (0 without a guard)."""
        return self.consistency.checks

    @property
    def mirrored_buffers(self) -> tuple[torch.Tensor, ...]:
        """The floating-point buffers (BatchNorm statistics) re-broadcast from replica 0 before each step."""
        return tuple(self.variable_sync.buffers)

    @property
    def input_sharding(self) -> InputSharding:
        return self._input_sharding

    @property
    def _guard(self) -> ReplicaGuard | None:
        """The consistency guard that runs (``consistency.active``), for the strategies' own collectives."""
        return self.consistency.active

    def process_name(self, index: int | None = None) -> str:
        """A readable name of process ``index`` (default: this one), for messages."""
        return self._comm.name(self._comm.rank if index is None else index)

    @property
    def container_strategy(self) -> Any:
        """The Strategy this belongs to, or None once it is gone."""
        return self._container_strategy_ref() if self._container_strategy_ref is not None else None

    def _container_strategy(self) -> Any:
        """TF's name for :attr:`container_strategy` (a method there)."""
        return self.container_strategy

    # ---------------------------------------------------------------- the step
    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs ``fn`` on this process's replica as one step of the job (what ``Strategy.run`` does).

        Distributed values in the arguments become this replica's part; variables created since
        the last step are synchronised first (a collective), and the result is kept for TF's
        regroup check at the next collective that reads it. Returns ``fn``'s result, unwrapped.
        """
        args, kwargs = tuple(args), dict(kwargs or {})
        # The global batch the arguments were sliced from travels with them (see global_batch).
        info = global_batch.find(args, kwargs) if self.consistency.active is not None else None
        if not all(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):  # plain tensors: hot path
            local = lambda v: v.values[0] if isinstance(v, DistributedValues) else v  # noqa: E731
            args, kwargs = nest.map_structure(local, args), nest.map_structure(local, kwargs)
        strategy, books = self.container_strategy, self.variable_sync
        self._step += 1
        self._comm.step = self._step  # the communicator names the step in its errors
        times = getattr(self._comm, "times", None)
        self.stats.step_began(times.seconds if times is not None else 0.0)
        # The flight recorder looks the step's source line up once, at its first collective (the
        # caller of `run` is where to look from a thread with no user frame: GPU autograd's).
        rec = getattr(self._comm, "recorder", None)
        saved = rec.enter_step(sys._getframe(1)) if rec is not None else None
        try:
            with context.enter_scope(strategy):
                with recording(self._comm, "variable sync"):
                    self._before_run()
                with (
                    context.enter_replica(strategy, self._comm.rank),
                    books.scope(strategy),
                    global_batch.using(info),
                    loss_scale_watch(self.gradient_sync, self._comm.world_size),
                    _device_contexts(strategy) if _DEVICE_CONTEXTS else contextlib.nullcontext(),
                ):
                    # The first step (and the first after new modules) watches for unsynchronised parameters.
                    result = fn(*args, **kwargs) if books.checked_first_run else books.first_run(fn, args, kwargs)
                self._after_run()
        finally:
            if rec is not None:
                rec.leave_step(saved)
        self.cross_replica.remember_result(result)
        return result

    def sync_variables(self) -> None:
        """Captures and synchronises the variables created since the last call, and joins to the
        gradient synchronisation the parameters that were frozen and now train (a collective, at
        scope exit and before each step; an integration may call it at a point every replica
        reaches, as Keras does before its first steps)."""
        self.variable_sync.capture_new_modules()
        self._sync_new_variables()
        thawed = self.variable_sync.take_thawed()
        if thawed:
            self._adopt_thawed(thawed)

    def _before_run(self) -> None:
        """Settles variables before a step: new ones synchronised, thawed ones joined, buffers re-broadcast."""
        self.gradient_sync.before_run()
        self.sync_variables()
        self.variable_sync.rebroadcast_buffers()
        self.gradient_sync.enter_step()

    def _after_run(self) -> None:
        """Settles what the gradient synchronisation keeps after a step (the central copy's update)."""
        self.gradient_sync.after_run()

    # ---------------------------------------------------------------- how gradients are synchronised
    def _make_gradient_sync(self) -> GradientSync:
        """The strategy's choice of :class:`~phalanx.core.gradient_sync.GradientSync`: here, an
        all-reduce into every replica's ``.grad`` where there are collectives, else nothing."""
        if not self._collectives:
            return GradientSync()
        return AllReduce(
            self._comm,
            self._cross_device_ops,
            self._bucket_bytes,
            self.consistency.active,
            thawed=self.variable_sync.take_thawed,
        )

    def _sync_new_variables(self) -> None:
        """Makes variables created since the last call identical everywhere and synchronised (collective)."""
        params = self.variable_sync.synchronise_new()
        if params is not None:
            self.gradient_sync.attach(params)

    def _adopt_thawed(self, params: list[torch.nn.Parameter]) -> None:
        """Parameters created frozen that now require gradients join the gradient synchronisation.

        Every replica unfreezes the same ones before the same ``run`` (the guard's fingerprint,
        due again, checks it); one that does not meets buckets of another size: a typed error.
        """
        self.mark_parameters_changed()
        self.gradient_sync.adopt_thawed(params)

    def _synchronised(self) -> list[torch.Tensor]:
        return self.gradient_sync.parameters()

    def _module_synchronized_elsewhere(self, module: torch.nn.Module) -> bool:
        """Whether another library keeps ``module``'s parameters consistent (FSDP2 swaps in its
        own gathered parameters during forward): the first step's watch leaves it alone."""
        return self.gradient_sync.synchronised_elsewhere(module)

    # ---------------------------------------------------------------- the contract: collectives
    def all_reduce(self, tensors: list[torch.Tensor], op: ReduceOp | str = ReduceOp.SUM) -> list[torch.Tensor]:
        """Reduces each tensor across all processes (integers averaged in floating point, as TF
        does), one message per dtype; new tensors, the same everywhere."""
        with recording(self._comm, "all_reduce"):
            return self.cross_replica.all_reduce(list(tensors), ReduceOp.from_any(op))

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Overwrites ``tensors`` in place with process ``src``'s values (one message per dtype)."""
        with recording(self._comm, "broadcast"):
            self.cross_replica.broadcast(list(tensors), src)

    def all_gather(self, tensor: Any, axis: int = 0) -> torch.Tensor:
        """Concatenates every process's ``tensor`` along ``axis`` in process order (lengths may differ)."""
        with recording(self._comm, "all_gather"):
            return self.cross_replica.all_gather(tensor, axis)

    def barrier(self) -> None:
        """Returns once every process of the job has called it."""
        if self._collectives:
            with recording(self._comm, "barrier"):
                self._comm.barrier()

    def adopt_variables(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Treats ``params`` as created in scope: broadcast from the chief, gradients synchronised.

        For variables built lazily, outside ``scope()`` (a Keras model built by its first step).
        Collective: every process calls it at the same point.
        """
        self.variable_sync.adopt(params)
        self._sync_new_variables()

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` (a parameter, buffer or Keras variable) was created under this strategy."""
        return self.variable_sync.created_in_scope(v)

    # ---------------------------------------------------------------- the contract: checkpoints
    # A strategy that keeps state away from the objects the user holds (the parameter servers'
    # optimizer state) or shards it overrides these (the CheckpointParticipant protocol).
    # The public methods are the implementations (here: as saved), overridden as they are.
    def state_to_save(self, obj: Any) -> Any:
        """The state of ``obj`` to store in a checkpoint, or None for ``obj.state_dict()``."""
        return None

    def after_restore(self, obj: Any) -> None:
        """Called after a checkpoint restored ``obj`` in place."""

    def state_to_restore(self, obj: Any, saved: Any) -> Any:
        """``saved`` in the form ``obj.load_state_dict`` takes under this strategy (a strategy that
        shards ``obj`` cuts each tensor to this replica's shard; a tensor written sharded arrives as
        a :class:`phalanx.checkpoint.distributed.Stored` to read into a shard, or to leave whole)."""
        return self.gradient_sync.state_to_restore(obj, saved)

    # ---------------------------------------------------------------- TF's library-author API
    def value_container(self, value: Any) -> Any:
        """The distributed container of ``value``: a variable is its own (one copy per process)."""
        return value

    def colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager[None]:
        """New variables go where ``colocate_with_variable`` is: this replica's device, where every
        variable of a process already lives (so it only checks its argument)."""
        value = getattr(colocate_with_variable, "value", None)
        if not isinstance(colocate_with_variable, torch.Tensor) and not isinstance(value, torch.Tensor):
            raise TypeError(f"colocate_vars_with needs a variable; received {type(colocate_with_variable).__name__}")
        return contextlib.nullcontext()

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any = None) -> Any:
        """Reduces a per-replica ``value`` across all replicas (a collective); the result, the
        same on every process, lies on the device of ``destinations`` (e.g. a variable)."""
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any, options: Any = None) -> list[Any]:
        """Many :meth:`reduce_to` in one fused collective per dtype (TF's gradient packing)."""
        op = ReduceOp.from_any(reduce_op)
        _refuse_in_replica_context(
            "reduce_to / batch_reduce_to are cross-replica APIs and were called inside run.",
            "call them in ReplicaContext.merge_call's function, or outside run",
        )
        pairs, values = list(value_destination_pairs), self.cross_replica
        # A value: see Strategy.reduce. Plain tensors follow TF's rule for them (CrossReplicaValues.reduce).
        reduced = [t.detach() for t in values.reduce(op, [v for v, _ in pairs], values.take_structure())]
        out = []
        for (_, dest), t in zip(pairs, reduced):
            dest_t = dest if isinstance(dest, torch.Tensor) else getattr(dest, "value", dest)
            out.append(t.to(dest_t.device) if isinstance(dest_t, torch.Tensor) else t)
        return out

    def update(
        self, var: Any, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, group: bool = True
    ) -> Any:
        """Runs ``fn(var, *args, **kwargs)`` on this process's copy of ``var`` (cross-replica context);
        every process runs the same update, so a mirrored variable stays identical."""
        if not callable(fn):
            raise NotCallableError(fn)
        _refuse_in_replica_context(
            "StrategyExtended.update is a cross-replica API and was called inside strategy.run.",
            "call it in ReplicaContext.merge_call's function",
        )
        local = lambda v: local_results(v)[0]  # noqa: E731
        args, kwargs = nest.map_structure(local, tuple(args)), nest.map_structure(local, dict(kwargs or {}))
        with torch.no_grad():
            result = fn(var, *args, **kwargs)
        return result if group else (result,)

    # ---------------------------------------------------------------- accumulation and consistency
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally (DDP's ``no_sync``); the first one
        after the block sums everything accumulated, as one-device accumulation would::

            for i, batch in enumerate(micro_batches):
                ctx = strategy.extended.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
                with ctx:
                    strategy.run(forward_backward, args=(batch,))
            strategy.run(lambda: (optimizer.step(), optimizer.zero_grad()))
        """
        return self.gradient_sync.no_sync()

    def mark_parameters_changed(self) -> None:
        """Says the synchronised parameters were changed outside training (a restore): the next
        gradient all-reduce checks that every replica holds the same values. Call it on every replica."""
        self.consistency.mark_changed()

    def set_consistency_checks(self, enabled: bool, *, fingerprint_every: int | None = None) -> None:
        """Turns the consistency guard on (the default) or off; call it on every replica at the same point.

        The guard adds ``4 x num_replicas`` numbers to each gradient all-reduce and to
        ``strategy.reduce``; under CentralStorageStrategy also to the step's two barriers, and
        where its gradients reach replica 0 only (gloo, without shared memory) they travel in one
        more small all-reduce of their own (cost: ``python -m benchmarks.consistency``).

        Args:
            enabled: whether the guard runs.
            fingerprint_every: steps between two fingerprints of the synchronised parameters
                (0: only at the first step and after a restore); None keeps the current value
                (``PHALANX_FINGERPRINT_EVERY``, default 100; cost: ``python -m benchmarks.fingerprint``).

        Raises:
            ValueError: ``fingerprint_every`` is not a non-negative integer.
        """
        self.gradient_sync.set_guard(self.consistency.set(enabled, fingerprint_every))

    def check_consistency(self) -> None:
        """Checks the guard's last unread result now (GPU replicas read it one step late, so that
        the host never waits for the GPU; a checkpoint calls this before it writes).

        Raises:
            ReplicaDivergenceError: the replicas disagreed at the last synchronised step.
        """
        self.gradient_sync.check_pending()

    def _close(self) -> None:
        try:
            self.gradient_sync.close()
        finally:
            self._comm.close()


def _refuse_in_replica_context(message: str, hint: str) -> None:
    if context.get_replica_context() is not None and context.has_strategy():
        raise ContextError(message, hint=hint)


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype is torch.bool)


def _count_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float64


def _detached(value: Any) -> Any:
    """``value`` cut from the autograd graph if it was computed in it (a loss, an output); a leaf
    tensor (a variable, an input) is returned itself."""
    return value.detach() if isinstance(value, torch.Tensor) and value.grad_fn is not None else value


def _ignored(api: str, parameter: str) -> None:
    """Warns that a parameter accepted for TF signature parity has no effect here."""
    warnings.warn(
        f"{api}({parameter}=...) is accepted for TensorFlow compatibility and has no effect in phalanx",
        UserWarning,
        stacklevel=3,
    )


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


ScopeEnterHook = Callable[["Strategy"], None]
_SCOPE_ENTER_HOOKS: list[ScopeEnterHook] = []
_SCOPE_HOOKS_LOCK = threading.Lock()


def register_scope_enter_hook(hook: ScopeEnterHook) -> None:
    """Calls ``hook(strategy)`` whenever a (non-default) strategy's ``scope()`` is entered.

    The extension point for integrations above the core: ``phalanx.keras`` joins it when it is
    imported, so the core itself never imports, or validates, Keras. Registering a hook twice
    has no effect.
    """
    with _SCOPE_HOOKS_LOCK:
        if hook not in _SCOPE_ENTER_HOOKS:
            _SCOPE_ENTER_HOOKS.append(hook)


DeviceContext = Callable[["Strategy"], "contextlib.AbstractContextManager[Any] | None"]
_DEVICE_CONTEXTS: list[DeviceContext] = []


def register_device_context(factory: DeviceContext) -> None:
    """Enters ``factory(strategy)`` (unless it returns None) around ``scope()`` and every ``run``.

    For a framework that places tensors on a default device of its own, so that what it makes
    inside the strategy lands on the replica's device, as TF places a replica's ops: Keras on the
    torch backend uses the GPU whenever one exists, also for CPU replicas. ``phalanx.keras``
    registers one; the factory should return None fast where nothing needs changing (it is
    called at every step). Registering a factory twice has no effect.
    """
    with _SCOPE_HOOKS_LOCK:
        if factory not in _DEVICE_CONTEXTS:
            _DEVICE_CONTEXTS.append(factory)


@contextlib.contextmanager
def _device_contexts(strategy: "Strategy") -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for factory in _DEVICE_CONTEXTS:
            cm = factory(strategy)
            if cm is not None:
                stack.enter_context(cm)
        yield


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
        from phalanx.input.context import ValueContext

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
