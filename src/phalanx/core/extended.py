"""``StrategyExtended``: the contract every strategy's machinery offers the rest of phalanx (TF's ``extended``).

A :class:`~phalanx.core.strategy.Strategy` is a thin object over its extended, which owns the
communicator, the replica's device and the captured variables, and hands the work to the
collaborators it holds and names (``variable_sync``, ``cross_replica``, ``consistency``,
``gradient_sync``: docs/ARCHITECTURE.md, "The contract"). Also here: :class:`InputSharding`, what
input reads of it, and :class:`CheckpointParticipant`, the checkpoint protocol it implements.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch

from phalanx import nest
from phalanx.comm.communicator import Communicator, LocalCommunicator
from phalanx.comm.cross_device_ops import CrossDeviceOps, NcclAllReduce
from phalanx.comm.flight_recorder import recording
from phalanx.comm.guard import ReplicaGuard
from phalanx.comm.reducer import DEFAULT_BUCKET_BYTES
from phalanx.core import context, rejoin
from phalanx.core.consistency import ConsistencyChecks
from phalanx.core.cross_replica import CrossReplicaValues
from phalanx.core.extension_points import _DEVICE_CONTEXTS, _device_contexts
from phalanx.core.gradient_sync import AllReduce, GradientSync
from phalanx.core.job_stats import JobStats
from phalanx.core.losses import loss_scale_watch
from phalanx.core.variable_sync import VariableSync
from phalanx.devices import LogicalDevice
from phalanx.errors import (
    ContextError,
    GroupChangedError,
    NotCallableError,
)
from phalanx.input import global_batch
from phalanx.input.distributed_dataset import slice_bounds
from phalanx.values import DistributedValues, ReduceOp, local_results


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
        self._elastic = callable(getattr(comm, "commit", None))  # an ElasticCommunicator's vote
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
        info = global_batch.find(args, kwargs) if self.consistency.active is not None or self.elastic else None
        if not all(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):  # plain tensors: hot path
            local = lambda v: v.values[0] if isinstance(v, DistributedValues) else v  # noqa: E731
            args, kwargs = nest.map_structure(local, args), nest.map_structure(local, kwargs)
        self._step += 1
        self._comm.step = self._step  # the communicator names the step in its errors
        times = getattr(self._comm, "times", None)
        self.stats.step_began(times.seconds if times is not None else 0.0)
        if not self.elastic:
            return self._run_step(fn, args, kwargs, info)
        while True:
            comm = self._comm
            if comm.joining or comm.grow_pending:  # a replacement joins at this step boundary
                args, kwargs, info = rejoin.admit(self, fn, args, kwargs, info)
            # A batch cut one ahead before the group changed is cut again by the current group.
            split = (self._comm.world_size, self._comm.rank)
            args, kwargs = global_batch.recut((args, kwargs), split, slice_bounds)
            try:
                return self._run_step(fn, args, kwargs, info)
            except GroupChangedError:
                # Every survivor abandoned this step's update; the group re-formed: run it again.
                self.gradient_sync.regrouped()
                self.consistency.regrouped()

    def caught_up(self, step: int) -> None:
        """A replacement replica that joined takes the group's step count (:mod:`phalanx.core.rejoin`)."""
        self._step = step
        self._comm.step = step

    @property
    def elastic(self) -> bool:
        """Whether the job goes on when it loses replicas (``phalanx run --min-nproc``; see
        :mod:`phalanx.comm.elastic`): ``num_replicas_in_sync`` may then change between steps."""
        return self._elastic

    def _run_step(self, fn: Callable[..., Any], args: tuple, kwargs: dict, info: Any) -> Any:
        strategy, books = self.container_strategy, self.variable_sync
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
