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

import contextlib
import functools
import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch

from phalanx import _integrations, compiled, config, context, global_batch, hooks, nest, regroup, variables
from phalanx._sidetable import IdentityTable
from phalanx.comm.communicator import Communicator, LocalCommunicator
from phalanx.comm.cross_device_ops import CrossDeviceOps, NcclAllReduce
from phalanx.comm.guard import ReplicaGuard, digits_for
from phalanx.comm.reducer import DEFAULT_BUCKET_BYTES, GradientReducer
from phalanx.devices import LogicalDevice
from phalanx.errors import (
    CollectiveMismatchError,
    ContextError,
    GatherShapeError,
    NonDistributedValueError,
    NotCallableError,
    RunStructureMismatchError,
    UnsynchronizedParameterError,
)
from phalanx.interactive import hooks as _interactive
from phalanx.nn import loss_scale_watch
from phalanx.values import DistributedValues, PerReplica, ReduceOp, local_results, mean_dtype

# Called as ``observe(strategy, fn)`` before each ``run``; phalanx.keras adds one for metrics.
RUN_OBSERVERS: list[Callable[[Any, Callable[..., Any]], None]] = []


def tf_device_name(device: LogicalDevice, task: str = "/job:localhost/replica:0/task:0") -> str:
    """TF's full name of ``device`` on ``task``, e.g. ``/job:localhost/replica:0/task:0/device:CPU:1``."""
    kind = "GPU" if device.type == "cuda" else device.type.upper()
    return f"{task}/device:{kind}:{device.index}"


_tf_name = tf_device_name  # the former private name


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

    The public members below are the contract the rest of phalanx (input, checkpoints, Keras,
    the coordinator) and user code rely on; the ``_`` members are this class's and its
    subclasses' own. Collectives (``all_reduce``, ``broadcast``, ``all_gather``, ``barrier``)
    must be called by every process of the job at the same point.

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
        self._comm = comm
        self._local_device = local_device
        self._worker_devices = worker_devices
        self._parameter_devices = parameter_devices
        self._cross_device_ops = cross_device_ops or NcclAllReduce()
        self._bucket_bytes = bucket_bytes
        self._new_params: list[torch.nn.Parameter] = []
        self._new_buffers: list[torch.Tensor] = []
        # id -> tensor of every variable created under this strategy (variable_created_in_scope);
        # by id, because tensors compare elementwise.
        self._created: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._buffers: list[torch.Tensor] = []
        self._reducer: GradientReducer | None = None
        self._step = 0
        self._synced: set[int] = set()  # ids of the parameters made identical (a WeakSet would compare tensors)
        # Synchronised parameters created frozen (requires_grad=False): their gradients join the
        # all-reduce when they are unfrozen (fine-tuning), checked at every `run`.
        self._frozen: list[torch.nn.Parameter] = []
        self._checked_first_run = comm.world_size == 1
        # Whether gradients, guard, extended.all_reduce and barriers go through the communicator:
        # with several replicas, or with one whose process group was built anyway
        # (PHALANX_SINGLE_REPLICA_COLLECTIVES=1: one GPU runs the real NCCL path, as DDP does).
        self._collectives = comm.world_size > 1 or not isinstance(comm, LocalCommunicator)
        # Every collective carries the replicas' step, batch and (first step, after a restore, then
        # every PHALANX_FINGERPRINT_EVERY steps) parameter fingerprint, so replicas that drifted
        # apart fail within one step, and replicas whose updates differ within that many steps.
        self._guard = (
            ReplicaGuard(comm, self._guard_fields, self._guarded_params, config.settings().fingerprint_every)
            if self._collectives
            else None
        )
        # Modules that registered a variable under this strategy's capture since the last sweep: what
        # they hold that no registration announced (copy.deepcopy, to_empty) is captured at scope
        # exit and before the next run (variables.capture_modules).
        self._new_modules: dict[int, tuple[torch.nn.Module, bool]] = {}  # id -> (module, with sub-modules)
        self._tag = next(_TAGS)  # marks the modules this strategy's scopes saw (variables.Capture.tag)
        if comm.world_size > 1:  # a torch optimizer's first step in `run` checks its parameters
            hooks.install("phalanx.strategy.optimizer_check", "optimizer_step_pre", _check_optimizer)
        self._input_sharding = input_sharding or InputSharding()
        self._container_strategy_ref: Any = None
        # The last `run` result no collective has compared across replicas yet (TF's regroup check).
        self._unchecked_result: Any = _NO_RESULT
        self._slot_buffers: dict[torch.dtype, tuple[torch.Tensor, Any]] = {}

    # ---------------------------------------------------------------- TF's public properties
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

    def process_name(self, index: int | None = None) -> str:
        """A readable name of process ``index`` (default: this one), for messages."""
        return self._comm.name(self._comm.rank if index is None else index)

    @property
    def device(self) -> torch.device:
        """This replica's torch device (``cpu`` for every logical CPU replica)."""
        return self._local_device.torch_device

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
    def communicator(self) -> Any:
        """The communicator behind the collectives (:mod:`phalanx.comm`), for tools and benchmarks."""
        return self._comm

    @property
    def consistency_checks(self) -> int:
        """How many collectives the consistency guard has checked so far (0 with one replica, or
        with the guard off), for tools and tests."""
        guard = self._guard if self._guard is not None else self._disabled_guard
        return guard.checks if guard is not None else 0

    @property
    def mirrored_buffers(self) -> tuple[torch.Tensor, ...]:
        """The floating-point buffers (BatchNorm statistics) re-broadcast from replica 0 before each step."""
        return tuple(self._buffers)

    @property
    def input_sharding(self) -> InputSharding:
        return self._input_sharding

    @property
    def container_strategy(self) -> Any:
        """The Strategy this belongs to, or None once it is gone."""
        ref = self._container_strategy_ref
        return ref() if ref is not None else None

    # ---------------------------------------------------------------- the contract: collectives
    def all_reduce(self, tensors: list[torch.Tensor], op: ReduceOp | str = ReduceOp.SUM) -> list[torch.Tensor]:
        """Reduces each tensor across all processes, one message per dtype; same result everywhere.

        Integer tensors are averaged in floating point (as TF does). Returns new tensors.
        """
        return self._all_reduce_tensors(list(tensors), ReduceOp.from_any(op))

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Overwrites ``tensors`` in place with process ``src``'s values (one message per dtype)."""
        self._broadcast_tensors(list(tensors), src)

    def all_gather(self, tensor: Any, axis: int = 0) -> torch.Tensor:
        """Concatenates every process's ``tensor`` along ``axis`` in process order (lengths may differ)."""
        return self._all_gather(tensor, axis)

    def barrier(self) -> None:
        """Returns once every process of the job has called it."""
        if self._collectives:
            self._comm.barrier()

    def adopt_variables(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Treats ``params`` as created in scope: broadcast from the chief, gradients synchronised.

        For variables built lazily, outside ``scope()`` (a Keras model built by its first step).
        Collective: every process calls it at the same point.
        """
        for p in params:
            if self._created.get(id(p)) is not p:  # not captured already (in scope or inside run)
                self._created[id(p)] = p
                self._new_params.append(p)
        self._sync_new_variables()

    # ---------------------------------------------------------------- the contract: checkpoints
    def state_to_save(self, obj: Any) -> Any:
        """The state of ``obj`` to store in a checkpoint, or None for ``obj.state_dict()``."""
        return self._state_to_save(obj)

    def after_restore(self, obj: Any) -> None:
        """Called after a checkpoint restored ``obj`` in place."""
        self._after_restore(obj)

    def state_to_restore(self, obj: Any, saved: Any) -> Any:
        """``saved`` (as a checkpoint holds it) in the form ``obj.load_state_dict`` takes under this
        strategy; a strategy that shards ``obj`` cuts each whole tensor to this replica's shard.
        A tensor written sharded arrives as a :class:`phalanx.checkpoint.distributed.Stored`
        placeholder: read it into a shard (``distributed.load_into``), or leave it, and the
        checkpoint reads it whole."""
        return self._state_to_restore(obj, saved)

    @property
    def _torch_device(self) -> torch.device:
        return self._local_device.torch_device

    # ---------------------------------------------------------------- variables
    def _variable_scope(self, owner: object, default_device: bool = True) -> variables.capture:
        return variables.capture(self._capture_spec(owner), default_device)

    def _capture_spec(self, owner: object) -> variables.Capture:
        return variables.Capture(
            owner,
            self._torch_device,
            self._on_new_parameter,
            self._on_new_buffer,
            self._on_new_module,
            self._tag,
            self._on_new_container,
        )

    # A strategy that works on whole models (FullyShardedStrategy) is told of each container a
    # module was registered on in scope; the others need not pay the call.
    _on_new_container: Callable[[torch.nn.Module], None] | None = None

    def _module_synchronized_elsewhere(self, module: torch.nn.Module) -> bool:
        """Whether another library keeps ``module``'s parameters consistent (FSDP2 swaps in its
        own gathered parameters during forward): the first step's watch leaves it alone."""
        return False

    def _on_new_module(self, module: torch.nn.Module, deep: bool) -> None:
        known = self._new_modules.get(id(module))
        self._new_modules[id(module)] = (module, deep or (known is not None and known[1]))

    def _capture_new_modules(self) -> None:
        """Captures what the modules seen since the last call hold that no registration announced
        (``copy.deepcopy``, ``to_empty``, ...): see :func:`phalanx.variables.capture_modules`.

        Called by every replica at the same point (scope exit, start of ``run``), before
        :meth:`_sync_new_variables`; nothing to do on a step that follows no new module.
        """
        if not self._new_modules:
            return
        modules, self._new_modules = list(self._new_modules.values()), {}
        # New modules: the next step watches its forward pass again (once), which also finds a
        # standalone copy.deepcopy of one of them (see _first_run).
        self._checked_first_run = self._comm.world_size == 1
        unfinished = variables.capture_modules(
            modules, self._capture_spec(self.container_strategy), lambda t: self._created.get(id(t)) is t
        )
        for module in unfinished:  # still on the meta device: swept again until materialised
            self._new_modules[id(module)] = (module, False)

    def _on_new_parameter(self, param: torch.nn.Parameter) -> None:
        if self._created.get(id(param)) is param:
            return  # registered again (Keras re-registers a built model's variables)
        self._created[id(param)] = param
        self._new_params.append(param)
        if context.get_replica_context() is not None:
            # Created inside `run` (a model built lazily by its first call): synchronise it now,
            # before this step's update makes the replicas' copies diverge (TF: one variable).
            self._sync_new_variables()

    def _on_new_buffer(self, buffer: torch.Tensor) -> None:
        if self._created.get(id(buffer)) is buffer:
            return  # registered again: broadcast (and re-broadcast each step) once
        self._created[id(buffer)] = buffer
        self._new_buffers.append(buffer)

    def _sync_new_variables(self) -> None:
        """Makes variables created since the last call identical everywhere and synchronised.

        Collective: called by every replica at the same point (scope exit, start of ``run``).
        """
        if not self._new_params and not self._new_buffers:
            return
        params, buffers = self._new_params, self._new_buffers
        self._new_params, self._new_buffers = [], []
        self._synced.update(id(p) for p in params)
        self.mark_parameters_changed()
        with torch.no_grad():
            self._broadcast_tensors([p.data for p in params] + list(buffers))
        for t in (*params, *buffers):  # a Checkpoint made outside scope() finds its strategy through them
            self._mark_owned(t)
        self._buffers += [b for b in buffers if b.is_floating_point()]
        self._frozen += [p for p in params if not p.requires_grad]
        if self._collectives:
            self._attach_gradient_sync(params)

    def _adopt_thawed(self, params: list[torch.nn.Parameter]) -> None:
        """Parameters created frozen that now require gradients join the gradient synchronisation.

        Collective: every replica unfreezes the same parameters before the same ``run`` (the
        guard's fingerprint, due again, checks that they still agree). A replica that does not
        meets buckets of another size: a typed error, not silent drift.
        """
        self.mark_parameters_changed()
        if self._collectives:
            self._attach_gradient_sync(params)

    def _attach_gradient_sync(self, params: list[torch.nn.Parameter]) -> None:
        num_packs = self._cross_device_ops.num_packs
        if self._reducer is None:
            self._reducer = GradientReducer(
                params,
                lambda flat: self._cross_device_ops.all_reduce(self._comm, flat, "sum"),
                self._bucket_bytes,
                num_packs,
                guard=self._guard,
            )
        else:
            self._reducer.add(params, self._bucket_bytes, num_packs)

    def _broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcasts many tensors from ``src`` in one message per dtype."""
        if self._comm.world_size == 1 or not tensors:
            return
        for group in by_dtype(tensors).values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self._comm.broadcast(flat, src=src)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _before_run(self) -> None:
        self._capture_new_modules()
        self._sync_new_variables()
        if self._frozen and any(p.requires_grad for p in self._frozen):
            thawed = [p for p in self._frozen if p.requires_grad]
            self._frozen = [p for p in self._frozen if not p.requires_grad]
            self._adopt_thawed(thawed)
        if self._buffers and self._comm.world_size > 1:
            # Replicas' running statistics (BatchNorm) drift apart; DDP re-broadcasts them per
            # step from replica 0 by default, and so do we.
            with torch.no_grad():
                self._broadcast_tensors(self._buffers)

    def _after_run(self) -> None:
        """Hook for strategies that must settle state after each step (mirrored: nothing to do)."""

    # ---------------------------------------------------------------- TF's library-author API
    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` (a parameter, buffer or Keras variable) was created under this strategy."""
        tensor = v if isinstance(v, torch.Tensor) else getattr(v, "value", v)  # phalanx.Variable: value()
        return self._created.get(id(tensor)) is tensor

    def value_container(self, value: Any) -> Any:
        """The distributed container of ``value``: a variable is its own (one copy per process)."""
        return value

    def colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager[None]:
        """Scope in which new variables go where ``colocate_with_variable`` is: this replica's
        device, where every variable of a process already lives (so it only checks its argument)."""
        if not isinstance(colocate_with_variable, torch.Tensor) and not isinstance(
            getattr(colocate_with_variable, "value", None), torch.Tensor
        ):
            raise TypeError(f"colocate_vars_with needs a variable; received {type(colocate_with_variable).__name__}")
        return contextlib.nullcontext()

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any = None) -> Any:
        """Reduces a per-replica ``value`` across all replicas (a collective); the result, the
        same on every process, lies on the device of ``destinations`` (e.g. a variable)."""
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any, options: Any = None) -> list[Any]:
        """Many :meth:`reduce_to` in one fused collective per dtype (TF's gradient packing)."""
        op = ReduceOp.from_any(reduce_op)
        if context.get_replica_context() is not None and context.has_strategy():
            raise ContextError(
                "reduce_to / batch_reduce_to are cross-replica APIs and were called inside run.",
                hint="call them in ReplicaContext.merge_call's function, or outside run",
            )
        pairs = list(value_destination_pairs)
        # A value: see Strategy.reduce. Plain tensors follow TF's rule for them (_reduce_values).
        reduced = [t.detach() for t in self._reduce_values(op, [v for v, _ in pairs], self._take_run_structure())]
        out = []
        for (_, dest), t in zip(pairs, reduced):
            dest_t = dest if isinstance(dest, torch.Tensor) else getattr(dest, "value", dest)
            out.append(t.to(dest_t.device) if isinstance(dest_t, torch.Tensor) else t)
        return out

    def update(
        self, var: Any, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, group: bool = True
    ) -> Any:
        """Runs ``fn(var, *args, **kwargs)`` on this process's copy of ``var`` (cross-replica context).

        Every process holds one copy and runs the same update, so a mirrored variable stays
        identical when the arguments are (e.g. the result of :meth:`reduce_to`).
        """
        if not callable(fn):
            raise NotCallableError(fn)
        if context.get_replica_context() is not None and context.has_strategy():
            raise ContextError(
                "StrategyExtended.update is a cross-replica API and was called inside strategy.run.",
                hint="call it in ReplicaContext.merge_call's function",
            )
        local = lambda v: local_results(v)[0]  # noqa: E731
        args, kwargs = nest.map_structure(local, tuple(args)), nest.map_structure(local, dict(kwargs or {}))
        with torch.no_grad():
            result = fn(var, *args, **kwargs)
        return result if group else (result,)

    # ---------------------------------------------------------------- accumulation and consistency
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally, without communicating (DDP's ``no_sync``).

        The first backward pass after the block sums everything accumulated since the last
        synchronisation, so the result equals one-device accumulation over the same global batches::

            for i, batch in enumerate(micro_batches):
                ctx = strategy.extended.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
                with ctx:
                    strategy.run(forward_backward, args=(batch,))
            strategy.run(lambda: (optimizer.step(), optimizer.zero_grad()))
        """
        return self._reducer.no_sync() if self._reducer is not None else contextlib.nullcontext()

    def mark_parameters_changed(self) -> None:
        """Says the synchronised parameters were changed outside training (a restore): the next
        gradient all-reduce checks that every replica holds the same values. Call it on every replica."""
        if self._guard is not None:
            self._guard.fingerprint_due = True

    def set_consistency_checks(self, enabled: bool, *, fingerprint_every: int | None = None) -> None:
        """Turns the consistency guard on (the default) or off; call it on every replica at the same point.

        The guard adds ``4 x num_replicas`` numbers to each gradient all-reduce and to
        ``strategy.reduce``; under CentralStorageStrategy also to the step's two barriers, and
        where its gradients reach replica 0 only (gloo, without shared memory) they travel in one
        more small all-reduce of their own (its cost is measured by
        ``python -m benchmarks.consistency``).

        Args:
            enabled: whether the guard runs.
            fingerprint_every: steps between two fingerprints of the synchronised parameters
                (0: only at the first step and after a restore); None keeps the current value
                (``PHALANX_FINGERPRINT_EVERY``, default 100; its cost: ``python -m benchmarks.fingerprint``).

        Raises:
            ValueError: ``fingerprint_every`` is not a non-negative integer.
        """
        if fingerprint_every is not None and (
            isinstance(fingerprint_every, bool) or not isinstance(fingerprint_every, int) or fingerprint_every < 0
        ):
            raise ValueError(f"fingerprint_every must be a non-negative integer; received {fingerprint_every!r}")
        guard = self._guard if self._guard is not None else self._disabled_guard
        if guard is None:
            return
        if fingerprint_every is not None:
            guard.every = fingerprint_every
        self._guard, self._disabled_guard = (guard, None) if enabled else (None, guard)
        if self._reducer is not None:
            self._reducer.guard = self._guard

    _disabled_guard: ReplicaGuard | None = None

    def _guard_fields(self) -> tuple[int, int, int]:
        info = global_batch.current()
        if info is None:
            return (self._step, 0, 0)
        # The batch each process sliced (where every process reads whole global batches) must be
        # the same size everywhere; an agreed sum over per-process pipelines would hide the difference.
        sliced = info.sliced_from if info.sliced_from is not None else info.global_size
        return (self._step, sliced, info.ordinal)

    def _guarded_params(self) -> list[tuple[str, torch.Tensor]]:
        if self._reducer is None:
            return []
        return [(variables.label_of(p), p) for p in self._reducer.parameters()]

    def _first_run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runs ``fn`` watching the modules it calls: a trainable parameter that no scope ever
        synchronised (a model created outside ``scope()``) differs on every replica and its
        gradient is never summed, so the first forward call of its module raises."""
        me = threading.get_ident()  # the hook is process-wide; other threads' modules are not ours
        checked: set[int] = set()

        def watch(module: torch.nn.Module, inputs: Any) -> None:
            if threading.get_ident() != me or id(module) in checked:
                return
            checked.add(id(module))
            if self._module_synchronized_elsewhere(module):
                return
            pending = {id(p) for p in self._new_params}  # created in this run: synchronised at the next
            if variables.copied_from_scope(module, self._tag) and any(
                isinstance(p, torch.nn.Parameter) and id(p) not in self._synced and id(p) not in pending
                for p in module.parameters(recurse=False)
            ):
                # A standalone copy.deepcopy of a module of this strategy's scope (a DQN's target
                # network): every replica reaches it in the same forward pass, so adopt it here, as
                # TF mirrors a copied variable: broadcast from the chief, gradients synchronised.
                self._on_new_module(module, False)
                self._capture_new_modules()
                self._sync_new_variables()
                return
            for name, p in module.named_parameters(recurse=False):
                # A plain tensor in a parameter's place is torch.func.functional_call's stand-in:
                # the caller's tensor, whose gradient is the caller's, not a variable of the model.
                stand_in = not isinstance(p, torch.nn.Parameter)
                if p.requires_grad and not stand_in and id(p) not in self._synced and id(p) not in pending:
                    raise UnsynchronizedParameterError(
                        f"{type(module).__name__}.{name} (shape {tuple(p.shape)})",
                        self._comm.name(self._comm.rank),
                        self._step,
                    )

        name = f"phalanx.strategy.first_run.{id(self)}.{me}"
        hooks.install(name, "module_forward_pre", watch)
        try:
            return fn(*args, **kwargs)
        finally:
            hooks.remove(name)
            self._checked_first_run = bool(checked)  # a step that called no module checks nothing

    # ---------------------------------------------------------------- collectives on values
    def _all_reduce_structure(self, op: ReduceOp, structure: Any) -> Any:
        leaves, spec = nest.flatten_with_spec(structure)
        tensors = [torch.as_tensor(local_results(v)[0]) for v in leaves]
        results = self._all_reduce_tensors(tensors, op)
        return nest.unflatten(results, spec)

    def _all_reduce_tensors(
        self, tensors: list[torch.Tensor], op: ReduceOp, structure: str | None = None
    ) -> list[torch.Tensor]:
        """One all-reduce per dtype. ``structure``: the last ``run`` result's description, compared
        across replicas by a digest in each replica's slot of the first message that can carry it."""
        if not self._collectives:
            return list(tensors)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            # Integer means are computed in floating point, with TF's true-division dtypes.
            dtype = t.dtype if (op is ReduceOp.SUM or t.is_floating_point()) else mean_dtype(t.dtype)
            groups.setdefault(dtype, []).append(i)
        if structure is not None and not any(d in regroup.SLOT_DTYPES for d in groups):
            self._check_structures(structure)  # no message can carry the digest: one of its own
            structure = None
        guarded = self._guard is not None and op is ReduceOp.SUM
        try:
            for dtype, idx in groups.items():
                pieces = [tensors[i].detach().to(dtype).reshape(-1) for i in idx]
                extra = slots = None
                if guarded and digits_for(dtype) is not None:
                    extra = self._guard.encode(dtype, pieces[0].device, with_parameters=False)
                    pieces.append(extra)
                    guarded = False
                if structure is not None and dtype in regroup.SLOT_DTYPES:
                    slots = self._structure_slots(structure, dtype, pieces[0].device)
                    pieces.append(slots)
                flat = torch.cat(pieces)
                # A mean that carries slots is summed here and divided below: the slots must stay exact.
                mean = op is ReduceOp.MEAN and slots is None
                flat = self._comm.all_reduce(flat, "mean" if mean else "sum").wait()
                end = flat.numel()
                if slots is not None:
                    self._verify_structures(flat[end - slots.numel() :], structure)
                    end -= slots.numel()
                    structure = None
                    if op is ReduceOp.MEAN:
                        flat[:end].div_(self._comm.world_size)
                if extra is not None:
                    self._guard.verify(flat[end - extra.numel() : end])
                offset = 0
                for i in idx:
                    n = tensors[i].numel()
                    out[i] = flat[offset : offset + n].view(tensors[i].shape)
                    offset += n
        except CollectiveMismatchError:
            if structure is not None:  # replicas with different results sent different messages
                self._check_structures(structure, exchange=True)
            raise
        return out  # type: ignore[return-value]

    def _reduce_values(self, op: ReduceOp, leaves: list[Any], structure: str | None = None) -> list[torch.Tensor]:
        """TF's one rule for ``reduce``, ``reduce_to`` and ``batch_reduce_to``.

        Distributed values are reduced across every replica. A value that is not distributed (a
        plain tensor) is one value per *worker*, as in TF where all of a worker's replicas share
        one process: on one worker, MEAN returns it and SUM over several replicas is refused
        (:class:`NonDistributedValueError`, TF's ValueError), except an all-zero non-tensor, which
        reduces to zeros; over several workers it is reduced across the workers (TF's
        testReduceHostTensor: SUM of 1.0 on 2 workers is 2.0).
        """
        n, workers = self.num_replicas_in_sync, max(self.input_sharding.num_workers, 1)
        tensors = [torch.as_tensor(local_results(v)[0]) for v in leaves]
        host = [not isinstance(v, DistributedValues) for v in leaves]
        if n == 1 or self._comm.world_size == 1:
            return tensors
        if workers == 1:
            for i, leaf in enumerate(leaves):
                if host[i] and op is ReduceOp.SUM:
                    if not isinstance(leaf, torch.Tensor) and not bool(torch.any(tensors[i] != 0)):
                        continue  # TF: a plain 0 (or array of zeros) reduces to zeros
                    raise NonDistributedValueError(leaf, op, n)
            shared = [i for i, h in enumerate(host) if not h]
            reduced = self._all_reduce_tensors([tensors[i] for i in shared], op, structure) if shared else []
            if not shared:
                self._check_structures(structure)
            for i, t in zip(shared, reduced):
                tensors[i] = t
            return tensors
        # Several workers: each worker's value counts once (its first replica's process sends it).
        per_worker = self._comm.world_size // workers
        first_of_worker = self._comm.rank % per_worker == 0
        sent = [t if (not h or first_of_worker) else torch.zeros_like(t) for t, h in zip(tensors, host)]
        sums = self._all_reduce_tensors(sent, ReduceOp.SUM, structure)
        if op is ReduceOp.SUM:
            return sums
        return [
            (s if s.is_floating_point() else s.to(mean_dtype(s.dtype))) / (workers if h else self._comm.world_size)
            for s, h in zip(sums, host)
        ]

    # ---------------------------------------------------------------- TF's regroup, across processes
    def _take_run_structure(self) -> str | None:
        """The description of the last ``run`` result, if no collective has compared it yet."""
        result = self._unchecked_result
        if result is _NO_RESULT:
            return None
        self._unchecked_result = _NO_RESULT
        return regroup.describe(result)

    def _structure_slots(self, description: str, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """A vector, zero but in this replica's slot, which holds the digest of ``description``."""
        if torch.device(device).type != "cpu":
            slots = torch.zeros(self._comm.world_size, dtype=dtype, device=device)
            slots[self._comm.rank] = regroup.digest(description)
            return slots
        # On the CPU a reused vector written through numpy: ~1 us instead of ~10 us of tensor calls
        # on every reduce after a run. Safe to reuse: the caller's torch.cat copies it.
        cached = self._slot_buffers.get(dtype)
        if cached is None:
            buffer = torch.zeros(self._comm.world_size, dtype=dtype)
            cached = self._slot_buffers[dtype] = (buffer, buffer.numpy())
        cached[1][self._comm.rank] = regroup.digest(description)
        return cached[0]

    def _verify_structures(self, slots: torch.Tensor, description: str) -> None:
        seen = slots.numpy() if slots.device.type == "cpu" else slots.cpu().numpy()
        if not (seen == seen[0]).all():
            self._check_structures(description, exchange=True)

    def _check_structures(self, description: str | None, exchange: bool = False) -> None:
        """Compares ``description`` across the replicas (a collective); raises on every replica if
        they differ. ``exchange``: they are known to differ, or may: send the descriptions."""
        if description is None or self._comm.world_size == 1:
            return
        if not exchange:
            slots = self._structure_slots(description, torch.int64, self.device).clone()
            try:
                self._comm.all_reduce(slots, "sum").wait()
            except CollectiveMismatchError:  # a peer sent a reduction of a result shaped otherwise
                slots = None
            if slots is not None and bool((slots == slots[0]).all()):
                return
        raw = torch.tensor(list(description.encode()), dtype=torch.uint8)
        texts = [bytes(p.tolist()).decode(errors="replace") for p in self._all_gather_list(raw)]
        if len(set(texts)) > 1:
            raise RunStructureMismatchError(texts, step=self._step)

    def _worker_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this worker's replicas (gathered from their processes)."""
        sharding = self.input_sharding
        per_worker = self._comm.world_size // max(sharding.num_workers, 1)
        if per_worker <= 1 or not isinstance(value, DistributedValues):
            return local_results(value)
        if not isinstance(value, PerReplica):
            return local_results(value) * per_worker  # the same on every replica
        mine = value.values[0]
        if isinstance(mine, str):  # a replica's text (a merge_call result, a ValueContext's str)
            raw = torch.tensor(list(mine.encode()), dtype=torch.uint8)
            texts = [bytes(p.tolist()).decode() for p in self._all_gather_list(raw)]
            everyone: list[Any] = texts
        elif isinstance(mine, (bool, int, float)):
            kind = type(mine)
            everyone = [kind(p.item()) for p in self._all_gather_list(torch.as_tensor(mine))]
        elif isinstance(mine, torch.Tensor) or hasattr(mine, "__array__"):
            everyone = self._all_gather_list(torch.as_tensor(mine))
        else:
            raise TypeError(
                f"experimental_local_results gathers this worker's replicas' values from their processes; it "
                f"gathers tensors, numbers and strings, not {type(mine).__name__} ({mine!r:.80}). HINT: return "
                "tensors from the function given to strategy.run"
            )
        first = sharding.worker_index * per_worker
        return tuple(everyone[first : first + per_worker])

    _MAX_RANK = 16  # dimensions a gathered tensor may have (the shapes travel in a fixed-size message)

    def _exchange_shapes(self, tensor: torch.Tensor) -> list[tuple[int, ...]]:
        """Every replica's shape of ``tensor`` (one small collective); refuses different dtypes."""
        if tensor.dim() > self._MAX_RANK:
            raise ValueError(
                f"gathering a tensor of rank {tensor.dim()} is not supported (at most {self._MAX_RANK}); "
                "reshape it first"
            )
        msg = torch.zeros(2 + self._MAX_RANK, dtype=torch.int64)
        msg[0], msg[1] = tensor.dim(), regroup.digest(str(tensor.dtype))
        msg[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        parts = self._comm.all_gather(msg)
        shapes = [tuple(int(d) for d in p[2 : 2 + int(p[0])]) for p in parts]
        if len({int(p[1]) for p in parts}) > 1:
            raise GatherShapeError(shapes, None, reason="the replicas' tensors have different dtypes")
        return shapes

    def _all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every replica's ``tensor``, whatever its shape, in replica order (two collectives)."""
        shapes = self._exchange_shapes(tensor)
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        flat = tensor.detach().reshape(-1)
        if flat.numel() < max(sizes):
            flat = torch.cat([flat, flat.new_zeros(max(sizes) - flat.numel())])
        parts = self._comm.all_gather(flat.contiguous())
        return [p[:n].reshape(s) for p, n, s in zip(parts, sizes, shapes)]

    def _all_gather(self, tensor: Any, axis: int) -> torch.Tensor:
        tensor = torch.as_tensor(local_results(tensor)[0])
        if self._comm.world_size == 1:
            return tensor
        # Replicas may hold different lengths along `axis` (an uneven last batch); any other
        # difference is refused on every replica at once (the shapes are exchanged first).
        shapes = self._exchange_shapes(tensor)
        ranks = {len(s) for s in shapes}
        if len(ranks) > 1:
            raise GatherShapeError(shapes, axis, reason="the replicas' tensors have different ranks")
        if tensor.dim() == 0:
            raise GatherShapeError(shapes, axis, reason="scalars cannot be concatenated (rank >= 1 is needed)")
        if not -tensor.dim() <= axis < tensor.dim():
            raise GatherShapeError(shapes, axis, reason=f"the axis is out of range for rank {tensor.dim()}")
        axis = axis % tensor.dim()
        if len({s[:axis] + s[axis + 1 :] for s in shapes}) > 1:
            raise GatherShapeError(shapes, axis, reason="their sizes differ off the gather axis")
        sizes = [s[axis] for s in shapes]
        longest = max(sizes)
        if tensor.shape[axis] < longest:
            pad_shape = list(tensor.shape)
            pad_shape[axis] = longest - tensor.shape[axis]
            tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=axis)
        parts = self._comm.all_gather(tensor.contiguous())
        return torch.cat([p.narrow(axis, 0, n) for p, n in zip(parts, sizes)], dim=axis)

    # Checkpoint hooks: a strategy that keeps some state away from the objects the user holds (the
    # parameter servers' optimizer state) gathers it for a save and sends it back after a restore.
    def _state_to_save(self, obj: Any) -> Any:
        """The state of ``obj`` to store in a checkpoint, or None for ``obj.state_dict()``."""
        return None

    def _after_restore(self, obj: Any) -> None:
        """Called after a checkpoint restored ``obj`` in place."""

    def _state_to_restore(self, obj: Any, saved: Any) -> Any:
        """``saved`` in the form ``obj.load_state_dict`` takes (here: as saved)."""
        return saved

    def _container_strategy(self) -> Any:
        """TF's name for :attr:`container_strategy`."""
        return self.container_strategy

    def _mark_owned(self, tensor: torch.Tensor) -> None:
        """Marks ``tensor`` as this strategy's variable, for a Checkpoint made outside ``scope()``."""
        _OWNERS[tensor] = weakref.ref(self)

    def check_consistency(self) -> None:
        """Checks the consistency guard's last unread result now (GPU replicas read it one step late).

        On CUDA replicas the guard's part of a step's gradient sum is read at the next step, so
        that the host never waits for the GPU; a checkpoint calls this before it writes. Collective
        only when a divergence is found (every replica finds it alike).

        Raises:
            ReplicaDivergenceError: the replicas disagreed at the last synchronised step.
        """
        reducer = getattr(self, "_reducer", None)  # a parameter-server strategy has none
        if reducer is not None:
            reducer.check_pending()

    def _close(self) -> None:
        if self._reducer is not None:
            try:
                self.check_consistency()
            finally:
                self._reducer.remove()
                self._comm.close()
            return
        self._comm.close()


_NO_RESULT = object()
_TAGS = itertools.count(1)
# Optimizers whose parameters were checked at their first step in a multi-replica `run`.
_CHECKED_OPTIMIZERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A torch optimizer's first step inside ``run`` of a multi-replica strategy: every parameter it
    updates with a gradient must be one the strategy synchronises. One that belongs to no module
    (a free ``nn.Parameter``) is not seen by ``scope()`` nor by the first step's module watcher, and
    would train apart on each replica silently. Costs one set lookup per later step."""
    if optimizer in _CHECKED_OPTIMIZERS or context.get_replica_context() is None or not context.has_strategy():
        return  # the first test is the one a checked optimizer's every later step makes (~0.2 us)
    ext = context.get_strategy().extended
    if ext._comm.world_size == 1:  # friend: a module-level helper of the core pair
        return
    pending = {id(p) for p in ext._new_params}  # friend
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and id(p) not in ext._synced and id(p) not in pending:  # friend
                raise UnsynchronizedParameterError(
                    variables.label_of(p),
                    ext._comm.name(ext._comm.rank),  # friend
                    ext._step,  # friend
                    updated_by=type(optimizer).__name__,
                )
    _CHECKED_OPTIMIZERS.add(optimizer)


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype is torch.bool)


def _count_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float64


def _detached(value: Any) -> Any:
    """``value`` cut from the autograd graph if it was computed in it (a loss, an output); a leaf
    tensor (a variable, an input) is returned itself."""
    return value.detach() if isinstance(value, torch.Tensor) and value.grad_fn is not None else value


def by_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    """Groups ``tensors`` by (dtype, device), keeping their order within each group."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


_by_dtype = by_dtype  # the former private name


# tensor -> weak reference to the StrategyExtended whose variable it is (a side table: nothing is
# attached to the tensor, so nothing of phalanx's travels with torch.save(module) or a deep copy).
_OWNERS: IdentityTable[weakref.ref] = IdentityTable()


def owner_of(tensor: torch.Tensor) -> "StrategyExtended | None":
    """The live strategy machinery whose variable ``tensor`` is, if a strategy marked it as one."""
    ref = _OWNERS.get(tensor)
    return ref() if ref is not None else None


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


def scope_enter_hooks() -> tuple[ScopeEnterHook, ...]:
    """The registered scope-enter hooks, in order."""
    return tuple(_SCOPE_ENTER_HOOKS)


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
        _integrations.activate_loaded()  # tf.keras needs no extra import; neither does Keras here
        for hook in _SCOPE_ENTER_HOOKS:
            hook(self)
        with context.enter_scope(self), _device_contexts(self):
            with self._extended._variable_scope(self):
                yield self
            if context.in_cross_replica_context():
                self._extended._capture_new_modules()
                self._extended._sync_new_variables()

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
        args, kwargs = tuple(args), dict(kwargs or {})
        ext = self._extended
        # The global batch the arguments were sliced from travels with them (see global_batch).
        info = global_batch.find(args, kwargs) if ext._guard is not None else None  # friend
        if not all(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            # Replace distributed values by this replica's part (skipped for plain tensors: hot path).
            local = lambda v: v.values[0] if isinstance(v, DistributedValues) else v  # noqa: E731
            args, kwargs = nest.map_structure(local, args), nest.map_structure(local, kwargs)
        _interactive.before_step()  # an interrupted notebook stops every replica at the same step
        for observe in RUN_OBSERVERS:
            observe(self, fn)
        ext = self._extended

        ext._step += 1  # friend: Strategy and its StrategyExtended are one object in two parts (TF's pairing)
        ext._comm.step = ext._step  # friend: the communicator names the step in its errors
        with context.enter_scope(self):
            ext._before_run()  # friend
            with (
                context.enter_replica(self, ext._comm.rank),
                ext._variable_scope(self, default_device=False),
                global_batch.using(info),
                loss_scale_watch(ext._reducer, ext._comm.world_size),
                _device_contexts(self) if _DEVICE_CONTEXTS else contextlib.nullcontext(),
            ):  # friend
                # friend: the first step watches for parameters no scope synchronised
                result = fn(*args, **kwargs) if ext._checked_first_run else ext._first_run(fn, args, kwargs)
            ext._after_run()  # friend
        if ext._comm.world_size > 1:  # friend
            ext._unchecked_result = result  # friend: compared at the first collective that reads it
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
        leaves, spec = nest.flatten_with_spec(value)
        ext = self._extended
        if ext._comm.world_size // max(ext.input_sharding.num_workers, 1) > 1:  # friend: a collective here
            ext._check_structures(ext._take_run_structure())  # friend: TF's regroup check
        if not leaves:
            return (value,)
        # Results of a replica's computation are values, as on several replicas of a host (gathered
        # copies there), not the replica's autograd graph; variables stay themselves.
        per_leaf = [tuple(map(_detached, self._extended._worker_local_results(v))) for v in leaves]
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
        leaves, spec = nest.flatten_with_spec(value)
        ext = self._extended
        structure = ext._take_run_structure()  # friend: TF's regroup check rides on this collective
        if axis is None:
            results = ext._reduce_values(op, leaves, structure)  # friend
        else:
            # TF reduces along `axis` inside `run` first, so every value is then per-replica, a plain
            # tensor too (SUM over N replicas counts it N times, as TF's does).
            tensors = [torch.as_tensor(local_results(leaf)[0]) for leaf in leaves]
            # Counts travel in the values' message where that dtype holds them exactly.
            counts = [torch.tensor(float(t.shape[axis]), dtype=_count_dtype(t.dtype), device=t.device) for t in tensors]
            # An integer sum keeps its dtype, as TF's reduce_sum (torch's sum would widen it to int64).
            tensors = [t.sum(dim=axis, dtype=t.dtype if _is_integer(t.dtype) else None) for t in tensors]
            if op is ReduceOp.SUM:
                results = ext._all_reduce_tensors(tensors, op, structure)  # friend
            else:
                # Sum the values and the element counts, then divide: exact for uneven replicas.
                sums = ext._all_reduce_tensors(tensors + counts, ReduceOp.SUM, structure)  # friend
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
        ext = self._extended
        ext._check_structures(ext._take_run_structure())  # friend: TF's regroup check
        workers = max(ext.input_sharding.num_workers, 1)
        per_worker = ext._comm.world_size // workers  # friend

        def gather_leaf(v: Any) -> torch.Tensor:
            if isinstance(v, DistributedValues) or ext._comm.world_size == 1:  # friend
                return ext._all_gather(v, axis).detach()  # friend
            # A plain tensor is one value per worker (TF): itself on one worker, else the workers' values.
            if workers == 1:
                return torch.as_tensor(v)
            everyone = ext._all_gather_list(torch.as_tensor(v).movedim(axis, 0))  # friend
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
    ``distribute_lib``: the context stack (:mod:`phalanx.context`) needs it and must not import
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
