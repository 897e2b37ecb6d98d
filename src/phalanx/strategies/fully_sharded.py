"""FullyShardedStrategy: data parallelism with parameters, gradients and optimizer state split across replicas.

Every other synchronous strategy keeps a whole copy of the model and its optimizer state on each
replica. This one keeps 1/N of each on each of N replicas, on torch's FSDP2 (``fully_shard``) and
DTensor: a module's parameters are gathered for its forward and backward, and its gradients are
summed and scattered back to their owners (reduce-scatter), so each replica's optimizer updates only
its own shard. The program is the one MirroredStrategy runs, strategy object aside.

What phalanx adds to FSDP2, so that the program needs no change:

* **When to shard.** Modules built in ``scope()`` are sharded when their variables are synchronised
  (scope exit, or the next ``run``): broadcast from replica 0 first, so every replica cuts the same
  tensor, then ``fully_shard`` on each module that holds at least ``min_params_to_shard`` parameter
  elements of its own, then on each root module (FSDP2's per-layer recipe).
* **The optimizer built before.** FSDP2 replaces each parameter by a sharded one; an optimizer built
  in scope from ``model.parameters()`` still holds the old ones, and its first step would update
  tensors nobody uses. An optimizer step pre-hook puts the sharded parameters in their place first.
* **Sums, as everywhere in phalanx.** ``compute_average_loss`` divides by the global batch, so the
  replicas' gradients are summed (FSDP2 averages by default).
* **Unused parameters left alone.** FSDP2 gives a parameter no replica used a zero gradient; one
  small all-reduce of per-parameter used flags at the end of backward gives it back the ``None``
  it has on one device (DDP's ``find_unused_parameters``), so momentum and weight decay skip it.
* **Checkpoints that move.** A save writes each replica's shards with
  ``torch.distributed.checkpoint`` (no replica ever holds a whole tensor,
  :mod:`phalanx.checkpoint.distributed`); a restore reads each replica's rows into its shards, from
  a checkpoint of any replica count, or cuts them out of the whole tensors another strategy saved.
  Restored under Mirrored, one device or plain PyTorch, the shards come back as whole tensors.
* **The guard.** Sharded parameters differ by design, so there is no fingerprint to compare; the
  first forward of a sharded model in each step begins with one small all-reduce of the
  consistency guard's fields, so replicas that are out of step (which FSDP2's equal-sized
  collectives would otherwise mix silently) fail with a typed error.

Example (``train.py``; two CPU replicas)::

    strategy = phalanx.FullyShardedStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters())
    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x, y))
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from phalanx import hooks
from phalanx._compat.torch import untraced
from phalanx.cluster import resolve_from_environment
from phalanx.comm import process_group
from phalanx.comm.flight_recorder import recording
from phalanx.core import capture, context
from phalanx.core.extended import StrategyExtended
from phalanx.core.gradient_sync import AllReduce, GradientSync
from phalanx.core.strategy import Strategy
from phalanx.errors import ClusterSpecError, ShardingError
from phalanx.strategies.mirrored import MirroredExtended
from phalanx.strategies.multi_worker_mirrored import MultiWorkerMirroredExtended
from phalanx.strategies.sharded_unused import UnusedParameters

# Parameters a module holds itself (not through sub-modules) from which it is sharded as its own
# group: about 4 MiB of float32, so a transformer block or a wide Linear is gathered on its own
# and the rest of a model goes with its root.
DEFAULT_MIN_PARAMS_TO_SHARD = 1 << 20

# The parameter fully_shard replaced -> its sharded successor, for optimizers built before the
# sharding (weak on the old tensor: once no optimizer holds it, the entry goes).
_SUCCESSORS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# How many times something was sharded in this process, and the count each optimizer last swapped
# at: an optimizer's step looks through its parameters only after a new sharding.
_GENERATION = [0]
_SWAPPED_AT: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


class ShardingAdaptation:
    """How to shard a model object that is more than a torch module (a Keras model): what an
    adapter of :data:`SHARDING_ADAPTERS` returns for a root module of its kind.

    Args:
        ignored: parameters left whole on every replica (``fully_shard``'s ``ignored_params``),
            their gradients all-reduced as under Mirrored: state the model updates in place
            during forward (FSDP2 does not write a gathered parameter back to its shards), or
            values that are not floating point.
        after: called with the root once it is sharded, to point the object's own references
            at the sharded parameters.
        parts: modules that are parts of the root without being torch sub-modules of it (a Keras
            model's layers): sharded with it, never as roots of their own.
    """

    def __init__(
        self,
        ignored: set[torch.nn.Parameter],
        after: Callable[[torch.nn.Module], None],
        parts: Sequence[torch.nn.Module] = (),
    ) -> None:
        self.ignored = ignored
        self.after = after
        self.parts = parts


# Adapters for model objects whose layers read their variables through references of their own
# (phalanx.keras registers Keras'): each is called with a root module about to be sharded and
# returns a ShardingAdaptation, or None when the module is not of its kind. A root an adapter
# takes is sharded as one group (its layers are not torch sub-modules of it).
SHARDING_ADAPTERS: list[Callable[[torch.nn.Module], "ShardingAdaptation | None"]] = []


def _fsdp() -> Any:
    """torch's FSDP2 module (``torch.distributed.fsdp``, public since torch 2.6).

    Raises:
        ShardingError: this torch has no FSDP2.
    """
    try:
        from torch.distributed import fsdp
        from torch.distributed.tensor import distribute_tensor  # noqa: F401 - checked here, used below
    except ImportError as e:  # pragma: no cover - torch 2.4/2.5
        raise ShardingError(
            torch.__version__, f"FullyShardedStrategy needs torch's FSDP2 ({e})", hint="install torch >= 2.6"
        ) from None
    if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch 2.4/2.5
        raise ShardingError(
            torch.__version__, "FullyShardedStrategy needs torch.distributed.fsdp.fully_shard", hint="torch >= 2.6"
        )
    return fsdp


def use_sharded_parameters(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Puts in ``optimizer`` the sharded parameters of those FSDP2 replaced (an optimizer step pre-hook).

    Idempotent, and a few dictionary lookups per parameter: it runs before every step of every
    optimizer once a FullyShardedStrategy sharded something.

    Raises:
        ShardingError: the optimizer already holds state for a parameter that was sharded since
            (it stepped, or was restored, before the sharding): whether the replicas' states agree
            is unknown, so it cannot be cut to the shard this replica owns.
    """
    if not _SUCCESSORS or _SWAPPED_AT.get(optimizer) == _GENERATION[0]:
        return  # nothing sharded, or nothing since this optimizer's last look: one lookup a step
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            new = _SUCCESSORS.get(p)
            if new is None:
                continue
            if optimizer.state.get(p):
                raise ShardingError(
                    capture.label_of(p),
                    "the optimizer holds state for this parameter from before FullyShardedStrategy sharded it",
                    hint="build the model and optimizer in strategy.scope(), restore a checkpoint after the scope, "
                    "and take the first step in strategy.run",
                )
            params[i] = new
    _SWAPPED_AT[optimizer] = _GENERATION[0]


def _check_min_params(min_params_to_shard: Any) -> int:
    if isinstance(min_params_to_shard, bool) or not isinstance(min_params_to_shard, int) or min_params_to_shard < 1:
        raise ShardingError(min_params_to_shard, "min_params_to_shard must be a positive integer")
    return min_params_to_shard


class Sharded(GradientSync):
    """FullyShardedStrategy's gradient synchronisation: the variables of modules built in scope are
    sharded with FSDP2 and their gradients reduce-scattered to their owners (see the module's
    docstring); variables on no module, and those an adapter keeps whole, are all-reduced as under
    Mirrored (an inner :class:`~phalanx.core.gradient_sync.AllReduce`).

    Args:
        comm: the communicator among the replicas (its store and addresses make FSDP2's group).
        device: this replica's torch device.
        variable_sync: the extended's books: told of every module seen in scope, and of the
            sharded parameters FSDP2 makes.
        guard: returns the consistency guard that runs (or None): checked at the first forward
            of a sharded model in each step.
        whole: the all-reduce of the variables that stay whole.
        min_params_to_shard, reshard_after_forward: as :class:`FullyShardedStrategy`'s.
    """

    def __init__(
        self,
        comm: Any,
        device: torch.device,
        variable_sync: Any,
        guard: Callable[[], Any],
        whole: AllReduce,
        min_params_to_shard: int,
        reshard_after_forward: bool,
    ) -> None:
        self._comm = comm
        self._device = device
        self._books = variable_sync
        self._guard_of = guard
        self._whole = whole
        self._fsdp = _fsdp()
        self._min_params_to_shard = min_params_to_shard
        self._reshard_after_forward = bool(reshard_after_forward)
        self._guard_checked = False
        # Every module seen registering a variable or a sub-module in scope (weak): the roots to
        # shard are those no other one holds.
        self._seen: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
        self._roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # sharded root modules
        self._mesh: Any = None
        self._owns_default_group = False
        self._unused = UnusedParameters(comm, self._fsdp.FSDPModule)  # .grad None where no replica used it
        variable_sync.on_container = variable_sync.on_module = self._remember_module
        hooks.install("phalanx.fully_sharded.optimizer", "optimizer_step_pre", use_sharded_parameters)

    # ---------------------------------------------------------------- what FSDP2 runs on
    def _device_mesh(self) -> Any:
        """A one-dimensional mesh over every replica, on torch's default process group.

        torch's DeviceMesh (and so FSDP2 and DTensor) works on the default group only. A program
        that made one (``dist.init_process_group`` under torchrun) keeps it, if it is this job's;
        otherwise phalanx makes it from the job's store, its gloo sockets on the task's own address.

        Raises:
            ClusterSpecError: the program's default group is not this job's (another size or rank).
        """
        if self._mesh is not None:
            return self._mesh
        comm = self._comm
        if dist.is_initialized():
            if (dist.get_world_size(), dist.get_rank()) != (comm.world_size, comm.rank):
                raise ClusterSpecError(
                    "torch.distributed default group",
                    f"rank {dist.get_rank()} of {dist.get_world_size()}",
                    f"this strategy's replica is rank {comm.rank} of {comm.world_size}",
                    hint="call dist.destroy_process_group() first, or let phalanx make the group",
                )
        else:
            spec = comm.spec  # type: ignore[attr-defined] # a ProcessGroupCommunicator: _collectives is true
            device = self._device.type
            process_group.init_default_group(
                "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
                dist.PrefixStore("fsdp/", comm.store),
                comm.rank,
                comm.world_size,
                timeout=datetime.timedelta(seconds=spec.timeout),
                bind_addr=spec.bind_addr,
            )
            self._owns_default_group = True
        from torch.distributed.device_mesh import init_device_mesh

        self._mesh = init_device_mesh(self._device.type, (comm.world_size,))
        return self._mesh

    # ---------------------------------------------------------------- variables
    def _remember_module(self, module: torch.nn.Module) -> None:
        self._seen[id(module)] = module

    def attach(self, params: list[torch.nn.Parameter]) -> None:
        # Identical on every replica by now (broadcast from the chief): shard their modules.
        if context.get_replica_context() is not None:
            raise ShardingError(
                capture.label_of(params[0]),
                "a parameter was created inside strategy.run, where FullyShardedStrategy cannot shard it",
                hint="build (or call once) the model in strategy.scope() before the first step",
            )
        self._shard(params)

    def adopt_thawed(self, params: list[torch.nn.Parameter]) -> None:
        # FSDP2 reduces whatever has a gradient; a whole variable joins its all-reduce.
        self._whole.attach(params)

    def _shard(self, params: list[torch.nn.Parameter]) -> None:
        """Shards the modules that hold ``params`` (identical on every replica by now)."""
        wanted = {id(p) for p in params}
        modules = [m for m in list(self._seen.values()) if any(id(p) in wanted for p in m.parameters())]
        children = {id(c) for m in modules for c in m.modules() if c is not m}
        roots = [m for m in modules if id(m) not in children and not isinstance(m, self._fsdp.FSDPModule)]
        adaptations = {id(root): _adaptation(root) for root in roots}
        parts = {id(m) for a in adaptations.values() if a is not None for m in a.parts}
        roots = _one_group_per_parameter([root for root in roots if id(root) not in parts])
        adaptations = {id(root): adaptations[id(root)] for root in roots}
        owned = {id(p) for m in roots for p in m.parameters()}
        loose = [p for p in params if id(p) not in owned]
        if loose:
            # On no module (a phalanx.Variable, TF's tf.Variable): FSDP2 shards modules, so these
            # stay whole on every replica with their gradients all-reduced, as under Mirrored.
            self._whole.attach(loose)
        ignored = [p for a in adaptations.values() if a is not None for p in a.ignored if p.is_floating_point()]
        if ignored:
            self._whole.attach(ignored)  # whole on every replica, as under Mirrored
        mesh = self._device_mesh()
        shard = self._fsdp.fully_shard
        with capture.not_captured():  # FSDP2's own registrations are not new variables
            for root in roots:
                before = dict(root.named_parameters())
                adaptation = adaptations[id(root)]
                if adaptation is None:
                    for sub in list(root.modules())[1:]:
                        own = sum(p.numel() for p in sub.parameters(recurse=False))
                        if own >= self._min_params_to_shard and not isinstance(sub, self._fsdp.FSDPModule):
                            shard(sub, mesh=mesh, reshard_after_forward=self._reshard_after_forward)
                    shard(root, mesh=mesh, reshard_after_forward=self._reshard_after_forward)
                else:
                    # Gathered from forward to the end of backward: Keras reads weights between the
                    # two (the loss's regularisation terms); one group holds them all anyway.
                    shard(root, mesh=mesh, reshard_after_forward=False, ignored_params=adaptation.ignored or None)
                for m in root.modules():
                    if isinstance(m, self._fsdp.FSDPModule):
                        # phalanx sums gradients (compute_average_loss divides by the global batch);
                        # FSDP2 averages unless told. Forced SUM: gloo has no PREMUL_SUM.
                        m.set_gradient_divide_factor(1.0)
                        force_sum = getattr(m, "set_force_sum_reduction_for_comms", None)
                        if force_sum is not None:
                            force_sum(True)
                        # A parameter one replica used and another did not: every replica takes
                        # part in the group's reduce-scatter with it (zeros where unused), so the
                        # collectives keep one layout (torch >= 2.9; before, they mismatch).
                        unused = getattr(m, "set_reduce_scatter_unused_params", None)
                        if unused is not None:
                            unused(True, recurse=False)
                for name, new in root.named_parameters():
                    old = before.get(name)
                    if old is not None and old is not new:
                        _SUCCESSORS[old] = new
                        _GENERATION[0] += 1
                        # An optimizer built in scope holds the whole tensor until its first step
                        # swaps in the shard: give the memory back now (FSDP2 frees its own
                        # gathered tensors the same way). The old parameter is dead from here.
                        with torch.no_grad():
                            old.data = old.data.new_empty(0)
                    self._books.register(new)
                self._roots.add(root)
                root.register_forward_pre_hook(untraced(_weak_hook(self._check_in_step)), prepend=True)
                self._unused.watch(root)  # after fully_shard: its hooks run after FSDP2's
                if adaptation is not None:
                    adaptation.after(root)

    def synchronised_elsewhere(self, module: torch.nn.Module) -> bool:
        # During forward FSDP2 swaps each sharded parameter for a gathered one of its own, which
        # no scope saw: the first step's watch must not take it for an unsynchronised parameter.
        return any(m is module for root in list(self._roots) for m in root.modules())

    # ---------------------------------------------------------------- the step
    def before_run(self) -> None:
        self._guard_checked = False

    def _check_in_step(self, module: torch.nn.Module, args: Any) -> None:
        """The consistency guard, at the first forward of a sharded model in each ``run``.

        Sharded parameters differ by design (nothing to fingerprint), and FSDP2's collectives are
        all of one size: replicas out of step would gather each other's shards silently. One small
        all-reduce of the guard's fields (step, global batch, batch ordinal) before the first
        gather of a step makes that a typed error. Here rather than at the start of ``run``: the
        step's batch is known only inside it.
        """
        guard = self._guard_of()
        if guard is None or self._guard_checked or context.get_replica_context() is None:
            return
        self._guard_checked = True
        contribution = guard.encode(torch.float64, with_parameters=False)
        if contribution is not None:
            # A copy: encode reuses its buffer, and the all-reduce sums in place.
            with recording(self._comm, "guard"):
                summed = self._comm.all_reduce(contribution.clone(), "sum").wait()
            guard.verify(summed)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate whole gradients locally (FSDP2's
        ``set_requires_gradient_sync(False)``, and the all-reduce of variables on no module); the
        first backward after the block reduces the sum."""
        with self._whole.no_sync(), self._gradient_sync(False):
            yield

    @contextlib.contextmanager
    def _gradient_sync(self, enabled: bool) -> Iterator[None]:
        modules = [m for root in self._roots for m in root.modules() if isinstance(m, self._fsdp.FSDPModule)]
        for m in modules:
            m.set_requires_gradient_sync(enabled, recurse=False)
        self._unused.syncing = enabled
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)
            self._unused.syncing = True

    # ---------------------------------------------------------------- checkpoints
    # Saving needs nothing of its own: a Checkpoint writes the DTensors of the objects' own
    # state_dicts with torch.distributed.checkpoint, each replica its own shards, so no replica
    # ever holds a whole tensor (phalanx.checkpoint.distributed).

    def state_to_restore(self, obj: Any, saved: Any) -> Any:
        """``saved`` with each tensor of a sharded parameter as this replica's shard: a tensor
        written sharded (on any number of replicas) is read into the shard directly, reading only
        its rows; a whole one (saved under another strategy) is cut. Local, no communication."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        from phalanx.checkpoint import distributed

        reads: list[tuple[distributed.Stored, torch.Tensor]] = []

        def cut(value: Any, like: Any) -> Any:
            if not isinstance(like, DTensor):
                return value
            if isinstance(value, distributed.Stored):
                if tuple(value.shape) != tuple(like.shape):
                    return value  # read whole: load_state_dict names the mismatch
                shard = distributed.empty_shard(value, like)
                reads.append((value, shard))
                return shard
            if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                return value
            if tuple(value.shape) != tuple(like.shape):
                return value  # load_state_dict names the mismatch
            local = value.to(device=like.device, dtype=like.dtype)
            return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)

        if isinstance(obj, torch.nn.Module) and isinstance(saved, dict):
            live = obj.state_dict()
            state = {k: cut(v, live.get(k)) for k, v in saved.items()}
        elif isinstance(obj, torch.optim.Optimizer) and isinstance(saved, dict) and "state" in saved:
            use_sharded_parameters(obj)
            params = [p for group in obj.param_groups for p in group["params"]]
            per_param = {
                index: {
                    k: cut(v, params[index]) if index < len(params) and getattr(v, "dim", lambda: 0)() > 0 else v
                    for k, v in entry.items()
                }
                for index, entry in saved["state"].items()
            }
            state = {**saved, "state": per_param}
        else:
            return saved
        distributed.load_into(reads)  # one read of the checkpoint's files for the whole object
        return state

    def scaled(self, factor: float) -> contextlib.AbstractContextManager[None]:
        return self._whole.scaled(factor)  # a sharded parameter's gradient is scaled by its owner (Keras)

    def scales(self, param: torch.Tensor) -> bool:
        return self._whole.scales(param)

    def parameters(self) -> list[torch.Tensor]:
        return self._whole.parameters()  # sharded ones differ by design: nothing to fingerprint

    @property
    def passes(self) -> int:
        return self._whole.passes

    def set_guard(self, guard: Any) -> None:
        self._whole.set_guard(guard)

    def check_pending(self) -> None:
        self._whole.check_pending()

    def close(self) -> None:
        try:
            self._whole.close()
        finally:
            if self._owns_default_group and dist.is_initialized():
                self._owns_default_group = False
                dist.destroy_process_group()


def _adaptation(root: torch.nn.Module) -> ShardingAdaptation | None:
    """What an adapter says about sharding ``root``; None for a plain torch module.

    Raises:
        ShardingError: a Keras model, and ``phalanx.keras`` (which adapts it) is not loaded.
    """
    for adapter in SHARDING_ADAPTERS:
        adaptation = adapter(root)
        if adaptation is not None:
            return adaptation
    if any(c.__module__.split(".")[0] == "keras" for c in type(root).__mro__):
        # Keras reads each variable through its own reference, not the module's parameter
        # FSDP2 swaps: sharding it unadapted would train tensors the model never uses.
        raise ShardingError(
            type(root).__name__,
            "a Keras model can be sharded only with phalanx.keras loaded",
            hint="import phalanx.keras before building the model (strategy.scope() does when keras is imported)",
        )
    return None


def _one_group_per_parameter(roots: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The roots to shard: FSDP2 puts a parameter in one group, so of roots that hold the same
    parameters one is sharded, the one holding the most (the latest seen among equals: ``roots``
    is in the order the scope saw them).

    A Keras model loaded from a file keeps the first internal graph it built of its layers alive
    beside itself, a second container of every weight: sharded twice, the first group's
    parameters were emptied under the second (a size-0 weight at the first step).

    Raises:
        ShardingError: two roots share some of their parameters but neither holds all of the
            other's (two models over one shared layer): no single group can hold them.
    """
    held = [{id(p) for p in root.parameters()} for root in roots]
    kept: list[int] = []
    for i in sorted(range(len(roots)), key=lambda i: (-len(held[i]), -i)):
        if any(held[i] <= held[k] for k in kept):
            continue  # every parameter of it is in a group already
        shared = next((k for k in kept if held[i] & held[k]), None)
        if shared is not None:
            raise ShardingError(
                f"{type(roots[i]).__name__} and {type(roots[shared]).__name__}",
                "two models built in scope share some parameters; FullyShardedStrategy shards each "
                "parameter in one model's group",
                hint="build the shared part and its users as one model, or share nothing",
            )
        kept.append(i)
    return [roots[i] for i in sorted(kept)]


def _weak_hook(method: Any) -> Any:
    """``method`` as a module hook that does not keep its strategy alive (the module outlives it)."""
    ref = weakref.WeakMethod(method)

    def hook(module: torch.nn.Module, args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(module, args)

    return hook


class _ShardedChoice(StrategyExtended):
    """Makes a synchronous extended's gradient synchronisation :class:`Sharded` (set
    ``_sharding`` before the extended's ``__init__``, which asks for it)."""

    _sharding: tuple[int, bool]

    def _make_gradient_sync(self) -> GradientSync:
        whole = super()._make_gradient_sync()
        if not isinstance(whole, AllReduce):
            return whole  # one replica without collectives: nothing to shard across
        min_params, reshard = self._sharding
        return Sharded(
            self._comm, self.device, self.variable_sync, lambda: self.consistency.active, whole, min_params, reshard
        )


class FullyShardedExtended(_ShardedChoice, MirroredExtended):
    """The machinery of :class:`FullyShardedStrategy` on one host: one replica per local device.

    Args:
        devices, min_params_to_shard, reshard_after_forward: as :class:`FullyShardedStrategy`'s.
    """

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        *,
        min_params_to_shard: int = DEFAULT_MIN_PARAMS_TO_SHARD,
        reshard_after_forward: bool = True,
    ) -> None:
        self._sharding = (_check_min_params(min_params_to_shard), bool(reshard_after_forward))
        _fsdp()  # before any replica starts
        MirroredExtended.__init__(self, devices)


class MultiWorkerFullyShardedExtended(_ShardedChoice, MultiWorkerMirroredExtended):
    """The machinery of :class:`FullyShardedStrategy` over a cluster (TF_CONFIG, torchrun, Slurm,
    ``phalanx run --nnodes``): every device of every worker, as MultiWorkerMirrored's.

    Args:
        cluster_resolver, communication_options: as :class:`MultiWorkerMirroredStrategy`'s.
        min_params_to_shard, reshard_after_forward: as :class:`FullyShardedStrategy`'s.
    """

    def __init__(
        self,
        cluster_resolver: Any = None,
        communication_options: Any = None,
        *,
        min_params_to_shard: int = DEFAULT_MIN_PARAMS_TO_SHARD,
        reshard_after_forward: bool = True,
    ) -> None:
        self._sharding = (_check_min_params(min_params_to_shard), bool(reshard_after_forward))
        _fsdp()
        MultiWorkerMirroredExtended.__init__(self, cluster_resolver, communication_options)


class FullyShardedStrategy(Strategy):
    """Synchronous data parallelism with parameters, gradients and optimizer state sharded across replicas.

    Each of N replicas keeps 1/N of every sharded module's parameters, gradients and optimizer
    state (torch FSDP2), so a model whose optimizer state does not fit one device trains on N.
    The training program is MirroredStrategy's: ``scope()``, ``run``, ``compute_average_loss``,
    ``experimental_distribute_dataset``, checkpoints; one replica per device of this host, or per
    process of ``phalanx run`` / torchrun / Slurm on many hosts.

    Args:
        devices: the replicas' devices on this host, as :class:`MirroredStrategy`'s
            (``["cpu:0", "cpu:1"]``). None: the cluster that ``cluster_resolver`` or the
            environment (TF_CONFIG, torchrun, Slurm) describes, as MultiWorkerMirroredStrategy
            runs it; without one, this host's devices.
        cluster_resolver: as :class:`MultiWorkerMirroredStrategy`'s.
        communication_options: as :class:`MultiWorkerMirroredStrategy`'s (timeout, implementation).
        min_params_to_shard: a sub-module holding at least this many parameter elements itself is
            gathered and freed as a group of its own (a layer); the rest goes with its root module.
        reshard_after_forward: free each group's gathered parameters after its forward pass, and
            gather them again for backward (FSDP2's default: least memory); False keeps them
            gathered from forward to backward (less communication).

    Raises:
        InvalidDeviceError: a device is malformed, absent or repeated.
        ShardingError: torch has no FSDP2, or ``min_params_to_shard`` is not a positive integer.

    Limits: parameters must be built in ``scope()``, not inside ``run``; a Keras model is sharded
    as one group (``phalanx.keras.sharding``), and Keras callbacks that read its weights on the
    chief alone are refused.
    """

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        *,
        cluster_resolver: Any = None,
        communication_options: Any = None,
        min_params_to_shard: int = DEFAULT_MIN_PARAMS_TO_SHARD,
        reshard_after_forward: bool = True,
    ) -> None:
        options = {"min_params_to_shard": min_params_to_shard, "reshard_after_forward": reshard_after_forward}
        if devices is not None and (cluster_resolver is not None or communication_options is not None):
            raise ClusterSpecError(
                "devices",
                devices,
                "FullyShardedStrategy takes the devices of one host, or a cluster, not both",
                hint="drop `devices` for a multi-worker job (each worker runs one replica per local device)",
            )
        # Devices named: one host, as MirroredStrategy. Otherwise a cluster the environment (or the
        # resolver) describes runs as MultiWorkerMirroredStrategy does; else this host's devices.
        if devices is None and (
            cluster_resolver is not None or communication_options is not None or resolve_from_environment() is not None
        ):
            extended: StrategyExtended = MultiWorkerFullyShardedExtended(
                cluster_resolver, communication_options, **options
            )
            super().__init__(extended, cluster_resolver=extended.cluster_resolver)  # type: ignore[attr-defined]
        else:
            super().__init__(FullyShardedExtended(devices, **options))
