"""The variables created under a strategy, made identical on every replica (``extended.variable_sync``).

TF creates one variable per replica under ``scope()`` and keeps them mirrored. Here each replica
is a process, so a variable created in scope (a parameter or buffer of a module built there,
also one created inside the first ``run``) is broadcast from the chief and its gradient joins
the strategy's synchronisation. This object keeps the books: what was created, what is still to
broadcast, which buffers are re-broadcast each step, which frozen parameters may thaw; it also
watches the first step for a trainable parameter that no scope saw, which would train apart on
each replica.

Example:
    >>> import torch, phalanx as px
    >>> strategy = px.OneDeviceStrategy("cpu")
    >>> with strategy.scope():
    ...     layer = torch.nn.Linear(2, 1)
    >>> strategy.extended.variable_sync.created_in_scope(layer.weight)
    True
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable

import torch

from phalanx import hooks
from phalanx._sidetable import IdentityTable
from phalanx.comm.communicator import Communicator
from phalanx.core import capture, context
from phalanx.errors import UnsynchronizedParameterError

_TAGS = itertools.count(1)
# tensor -> weak reference to the StrategyExtended whose variable it is (a side table: nothing is
# attached to the tensor, so nothing of phalanx's travels with torch.save(module) or a deep copy).
_OWNERS: IdentityTable[weakref.ref] = IdentityTable()
# Optimizers whose parameters were checked at their first step in a multi-replica `run`.
_CHECKED_OPTIMIZERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def owner_of(tensor: torch.Tensor) -> Any:
    """The live strategy machinery (``StrategyExtended``) whose variable ``tensor`` is, if any."""
    ref = _OWNERS.get(tensor)
    return ref() if ref is not None else None


class VariableSync:
    """The capture of one strategy's variables and the bookkeeping of their synchronisation.

    What a strategy does with new variables (all-reduce their gradients, centralise them, shard
    them, place them on servers) is its own: it asks :meth:`take_new` or :meth:`synchronise_new`
    at the points the extended decides (scope exit, start of ``run``).

    Args:
        owner: the ``StrategyExtended`` these variables belong to (found by :func:`owner_of`).
        comm: the communicator among the replicas (names and step in errors).
        device: where variables created in ``scope()`` go.
        broadcast: sends tensors from the chief to every replica, in place (a collective).
        mark_changed: tells the consistency guard the parameters were set outside training.
        synchronise: the strategy's synchronisation of what was created since its last call
            (``extended._sync_new_variables``), run for a variable made inside ``run``.
        synchronised_elsewhere: whether another library keeps a module's parameters consistent
            (FSDP2's gathered ones): the first step's watch leaves it alone.
        step: the step the job is at, for error messages.
    """

    def __init__(
        self,
        owner: Any,
        comm: Communicator,
        device: torch.device,
        broadcast: Callable[[list[torch.Tensor]], None],
        mark_changed: Callable[[], None],
        synchronise: Callable[[], None],
        synchronised_elsewhere: Callable[[torch.nn.Module], bool],
        step: Callable[[], int],
    ) -> None:
        self._owner = weakref.ref(owner)
        self._comm = comm
        self._device = device
        self._broadcast = broadcast
        self._mark_changed = mark_changed
        self._synchronise = synchronise
        self._elsewhere = synchronised_elsewhere
        self._step = step
        self.new_params: list[torch.nn.Parameter] = []  # created since the last synchronisation
        self.new_buffers: list[torch.Tensor] = []
        # id -> tensor of every variable created under this strategy (by id: tensors compare elementwise).
        self.created: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self.buffers: list[torch.Tensor] = []  # floating-point buffers, re-broadcast from replica 0 each step
        self.synced: set[int] = set()  # ids of the parameters made identical (a WeakSet would compare tensors)
        # Synchronised parameters created frozen (requires_grad=False): their gradients join the
        # synchronisation when they are unfrozen (fine-tuning), checked at every `run`.
        self.frozen: list[torch.nn.Parameter] = []
        # Modules that registered a variable under this capture since the last sweep: what they hold
        # that no registration announced (copy.deepcopy, to_empty) is captured at scope exit and
        # before the next run (capture.capture_modules).
        self._new_modules: dict[int, tuple[torch.nn.Module, bool]] = {}  # id -> (module, with sub-modules)
        self.tag = next(_TAGS)  # marks the modules this strategy's scopes saw (capture.Capture.tag)
        #: Whether the next step may skip the first-step watch (no new module since the last one).
        self.checked_first_run = comm.world_size == 1
        # Told of each module (and each container, for strategies that work on whole models) a
        # variable was registered on in scope; the others need not pay the call.
        self.on_module: Callable[[torch.nn.Module], None] | None = None
        self.on_container: Callable[[torch.nn.Module], None] | None = None
        if comm.world_size > 1:  # a torch optimizer's first step in `run` checks its parameters
            hooks.install("phalanx.core.strategy.optimizer_check", "optimizer_step_pre", _check_optimizer)

    # ---------------------------------------------------------------- the capture
    def scope(self, owner: object) -> capture.capture:
        """The capture of ``owner``'s scope (``scope()``, and each ``run``)."""
        return capture.capture(self._spec(owner))

    def _spec(self, owner: object) -> capture.Capture:
        return capture.Capture(
            owner,
            self._device,
            self._on_new_parameter,
            self._on_new_buffer,
            self.on_new_module,
            self.tag,
            self.on_container,
            self.on_materialized,
            self.capture_new_modules,
        )

    def on_materialized(self, module: torch.nn.Module) -> None:
        """A lazy module's first forward gave its parameters their values: inside ``run`` they are
        captured and synchronised now, before that forward uses them (every replica calls the
        module at the same point), as a Keras layer built by its first call is; elsewhere at the
        next synchronisation (scope exit, the next ``run``)."""
        self.on_new_module(module, False)
        if context.get_replica_context() is not None:
            self.capture_new_modules()
            self._synchronise()

    def on_new_module(self, module: torch.nn.Module, deep: bool) -> None:
        """Remembers ``module`` to sweep at the next :meth:`capture_new_modules`."""
        known = self._new_modules.get(id(module))
        self._new_modules[id(module)] = (module, deep or (known is not None and known[1]))
        if self.on_module is not None:
            self.on_module(module)

    def capture_new_modules(self) -> None:
        """Captures what the modules seen since the last call hold that no registration announced
        (``copy.deepcopy``, ``to_empty``, ...): see :func:`phalanx.core.capture.capture_modules`.

        Called by every replica at the same point (scope exit, start of ``run``), before the
        strategy synchronises new variables; nothing to do on a step that follows no new module.
        """
        if not self._new_modules:
            return
        modules, self._new_modules = list(self._new_modules.values()), {}
        # New modules: the next step watches its forward pass again (once), which also finds a
        # standalone copy.deepcopy of one of them (see first_run).
        self.checked_first_run = self._comm.world_size == 1
        owner = self._owner()
        unfinished = capture.capture_modules(
            modules,
            self._spec(owner.container_strategy if owner is not None else None),
            lambda t: self.created.get(id(t)) is t,
        )
        for module in unfinished:  # still on the meta device: swept again until materialised
            self._new_modules[id(module)] = (module, False)

    def _on_new_parameter(self, param: torch.nn.Parameter) -> None:
        if self.created.get(id(param)) is param:
            return  # registered again (Keras re-registers a built model's variables)
        self.created[id(param)] = param
        self.new_params.append(param)
        if context.get_replica_context() is not None:
            # Created inside `run` (a model built lazily by its first call): synchronise it now,
            # before this step's update makes the replicas' copies diverge (TF: one variable).
            self._synchronise()

    def _on_new_buffer(self, buffer: torch.Tensor) -> None:
        if self.created.get(id(buffer)) is buffer:
            return  # registered again: broadcast (and re-broadcast each step) once
        self.created[id(buffer)] = buffer
        self.new_buffers.append(buffer)

    def adopt(self, params: Any) -> None:
        """Treats ``params`` as created in scope (variables built lazily, outside ``scope()``)."""
        for p in params:
            if self.created.get(id(p)) is not p:  # not captured already (in scope or inside run)
                self.created[id(p)] = p
                self.new_params.append(p)

    def created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` (a parameter, buffer or Keras variable) was created under this strategy."""
        tensor = v if isinstance(v, torch.Tensor) else getattr(v, "value", v)  # phalanx.Variable: value()
        return self.created.get(id(tensor)) is tensor

    def register(self, tensor: torch.Tensor) -> None:
        """Records ``tensor`` as a synchronised variable of this strategy (one a library made from
        a captured one, as FSDP2 makes a sharded parameter)."""
        self.created[id(tensor)] = tensor
        self.synced.add(id(tensor))
        self.mark_owned(tensor)

    def mark_owned(self, tensor: torch.Tensor) -> None:
        """Marks ``tensor`` as this strategy's variable, for a Checkpoint made outside ``scope()``."""
        _OWNERS[tensor] = self._owner

    # ---------------------------------------------------------------- synchronisation
    def take_new(self) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
        """The parameters and buffers created since the last call (no longer pending after it)."""
        params, buffers = self.new_params, self.new_buffers
        self.new_params, self.new_buffers = [], []
        return params, buffers

    def synchronise_new(self) -> list[torch.nn.Parameter] | None:
        """Broadcasts what was created since the last call from the chief (a collective).

        Returns:
            The new parameters, for the strategy to attach its gradient synchronisation to, or
            None when nothing was created.
        """
        if not self.new_params and not self.new_buffers:
            return None
        params, buffers = self.take_new()
        self.synced.update(id(p) for p in params)
        self._mark_changed()
        with torch.no_grad():
            self._broadcast([p.data for p in params] + list(buffers))
        for t in (*params, *buffers):  # a Checkpoint made outside scope() finds its strategy through them
            self.mark_owned(t)
        self.buffers += [b for b in buffers if b.is_floating_point()]
        self.frozen += [p for p in params if not p.requires_grad]
        return params

    def take_thawed(self) -> list[torch.nn.Parameter]:
        """The parameters created frozen that require gradients now (no longer frozen after it)."""
        if not self.frozen or not any(p.requires_grad for p in self.frozen):
            return []
        thawed = [p for p in self.frozen if p.requires_grad]
        self.frozen = [p for p in self.frozen if not p.requires_grad]
        return thawed

    def rebroadcast_buffers(self) -> None:
        """Replicas' running statistics (BatchNorm) drift apart; DDP re-broadcasts them per step
        from replica 0 by default, and so do we (a collective)."""
        if self.buffers and self._comm.world_size > 1:
            with torch.no_grad():
                self._broadcast(self.buffers)

    # ---------------------------------------------------------------- the first step's watch
    def first_run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runs ``fn`` watching the modules it calls: a trainable parameter that no scope ever
        synchronised (a model created outside ``scope()``) differs on every replica and its
        gradient is never summed, so the first forward call of its module raises.

        Raises:
            UnsynchronizedParameterError: a module called holds such a parameter.
        """
        me = threading.get_ident()  # the hook is process-wide; other threads' modules are not ours
        checked: set[int] = set()

        def watch(module: torch.nn.Module, inputs: Any) -> None:
            if threading.get_ident() != me or id(module) in checked:
                return
            checked.add(id(module))
            if self._elsewhere(module):
                return
            pending = {id(p) for p in self.new_params}  # created in this run: synchronised at the next
            if capture.copied_from_scope(module, self.tag) and any(
                isinstance(p, torch.nn.Parameter) and id(p) not in self.synced and id(p) not in pending
                for p in module.parameters(recurse=False)
            ):
                # A standalone copy.deepcopy of a module of this strategy's scope (a DQN's target
                # network): every replica reaches it in the same forward pass, so adopt it here, as
                # TF mirrors a copied variable: broadcast from the chief, gradients synchronised.
                self.on_new_module(module, False)
                self.capture_new_modules()
                self._synchronise()
                return
            for name, p in module.named_parameters(recurse=False):
                # A plain tensor in a parameter's place is torch.func.functional_call's stand-in:
                # the caller's tensor, whose gradient is the caller's, not a variable of the model.
                stand_in = not isinstance(p, torch.nn.Parameter)
                if capture.is_lazy(p):
                    continue  # materialised by this call, then synchronised (on_materialized)
                if p.requires_grad and not stand_in and id(p) not in self.synced and id(p) not in pending:
                    raise UnsynchronizedParameterError(
                        f"{type(module).__name__}.{name} (shape {tuple(p.shape)})",
                        self._comm.name(self._comm.rank),
                        self._step(),
                    )

        name = f"phalanx.core.strategy.first_run.{id(self)}.{me}"
        hooks.install(name, "module_forward_pre", watch)
        try:
            return fn(*args, **kwargs)
        finally:
            hooks.remove(name)
            self.checked_first_run = bool(checked)  # a step that called no module checks nothing

    def unsynchronised(self, param: torch.Tensor) -> bool:
        """Whether ``param`` trains apart on each replica: neither synchronised nor about to be."""
        return id(param) not in self.synced and all(p is not param for p in self.new_params)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A torch optimizer's first step inside ``run`` of a multi-replica strategy: every parameter it
    updates with a gradient must be one the strategy synchronises. One that belongs to no module
    (a free ``nn.Parameter``) is not seen by ``scope()`` nor by the first step's module watcher, and
    would train apart on each replica silently. Costs one set lookup per later step."""
    if optimizer in _CHECKED_OPTIMIZERS or context.get_replica_context() is None or not context.has_strategy():
        return  # the first test is the one a checked optimizer's every later step makes (~0.2 us)
    ext = context.get_strategy().extended
    if ext.num_processes == 1:
        return
    books: VariableSync = ext.variable_sync
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and books.unsynchronised(p):
                raise UnsynchronizedParameterError(
                    capture.label_of(p), ext.process_name(), ext.step, updated_by=type(optimizer).__name__
                )
    _CHECKED_OPTIMIZERS.add(optimizer)
