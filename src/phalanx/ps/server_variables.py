"""The chief's variables on the parameter servers: where each is placed, and the chief's copies.

:class:`ServerVariables` is the collaborator a
:class:`~phalanx.ps.parameter_server_strategy.ParameterServerExtended` holds for its variables
(``extended.server_variables``): each parameter or buffer created in ``scope()`` on the chief gets a
:class:`~phalanx.ps.remote_variables.VariableSpec` (placed round robin over the servers, split
into shards by the ``variable_partitioner``) and is created on the servers; the chief keeps an
ordinary tensor, pulled from the servers and pushed to them when it changed (torch's version
counter); a scheduled function carries a reference to it, not a copy; checkpoints fetch and send
back the optimizer state that lives on the servers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx._compat.torch import version_counter
from phalanx.ps import wire
from phalanx.ps.partitioners import num_shards_for, shard_sizes
from phalanx.ps.remote_variables import RemoteVariable, Shard, ShardedVariable, ShardIO, VariableSpec

__all__ = ["ServerVariables"]

log = logging.getLogger("phalanx.ps")


class ServerVariables:
    """The variables a chief created on the parameter servers (see the module docstring).

    Args:
        io: reads and writes of the variables' shards on the servers.
        num_ps: how many parameter servers there are.
        partitioner: TF's ``variable_partitioner`` (how many shards a variable gets), or None.
        mark_owned: told of each tensor that became a variable (the strategy's ``variable_sync``).
    """

    def __init__(
        self,
        io: ShardIO,
        num_ps: int,
        partitioner: Callable[..., Sequence[int]] | None,
        mark_owned: Callable[[torch.Tensor], None],
    ) -> None:
        self.io, self._num_ps, self._partitioner, self._mark_owned = io, num_ps, partitioner, mark_owned
        self.specs: list[VariableSpec] = []
        self._tensors: dict[str, torch.Tensor] = {}
        self._spec_by_id: dict[int, VariableSpec] = {}
        self._by_storage: dict[tuple, VariableSpec] = {}
        self._json: dict[str, str] = {}
        self._versions: dict[str, int] = {}
        self._next_ps = 0
        self._count = 0
        self._warned_outside_scope = False

    def create(self, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        """Creates the variables of new ``params`` and ``buffers`` (made in scope) on the servers."""
        new = []
        for tensor, kind in [*((p, "parameter") for p in params), *((b, "buffer") for b in buffers)]:
            if id(tensor) in self._spec_by_id:
                continue
            alias = self._by_storage.get(_storage_key(tensor)) if tensor.numel() else None
            if alias is not None:
                # A new tensor object over an existing variable's memory (Keras re-wraps its
                # variables in new Parameters as a model is built): the same variable, now
                # reached through this object.
                self._tensors[alias.name] = tensor
                self._spec_by_id[id(tensor)] = alias
                self._versions[alias.name] = version_counter(tensor)
                self._mark_owned(tensor)
                continue
            new.append((tensor, kind))
        # Within this batch too, one variable per memory: the last object over it is the one in use.
        latest = {_storage_key(t): i for i, (t, _) in enumerate(new) if t.numel()}
        new = [(t, kind) for i, (t, kind) in enumerate(new) if not t.numel() or latest[_storage_key(t)] == i]
        specs = [self._place(t, kind) for t, kind in new]
        tensors = [t for t, _ in new]
        existing = self.io.create(specs, tensors)
        for spec, tensor in zip(specs, tensors):
            self._register(spec, tensor)
        if existing:
            # A restarted coordinator: the servers kept these variables; adopt their values.
            log.info("phalanx: %d variables already exist on the parameter servers; using their values", len(existing))
            self.pull([n for n in (s.name for s in specs) if n in existing])

    def _place(self, tensor: torch.Tensor, kind: str) -> VariableSpec:
        name = f"v{self._count}"
        self._count += 1
        shape = tuple(int(d) for d in tensor.shape)
        num_ps = self._num_ps
        sizes = shard_sizes(shape[0], num_shards_for(self._partitioner, shape, tensor.dtype)) if shape else [1]
        if len(sizes) == 1:
            shards: tuple[Shard, ...] = (Shard(self._next_ps % num_ps, name, 0, -1),)
        else:
            starts = [sum(sizes[:j]) for j in range(len(sizes))]
            shards = tuple(
                Shard((self._next_ps + j) % num_ps, f"{name}/part_{j}", starts[j], rows) for j, rows in enumerate(sizes)
            )
        self._next_ps += len(shards)  # round robin over servers, shards included (as TF places them)
        trainable = kind == "parameter" and tensor.requires_grad
        return VariableSpec(name, shape, wire.dtype_name(tensor.dtype), trainable, kind, shards)

    def _register(self, spec: VariableSpec, tensor: torch.Tensor) -> None:
        self.specs.append(spec)
        self._tensors[spec.name] = tensor
        self._spec_by_id[id(tensor)] = spec
        self._json[spec.name] = spec.to_json()
        self._versions[spec.name] = version_counter(tensor)
        if tensor.numel():
            self._by_storage[_storage_key(tensor)] = spec  # registered tensors stay alive: no address reuse
        self._mark_owned(tensor)  # a Checkpoint made outside scope() finds the servers' state through it

    def reference(self, obj: torch.Tensor) -> Any:
        """The reference a scheduled function carries for the chief's tensor ``obj``: its variable, or None."""
        spec = self._spec_by_id.get(id(obj))
        if spec is not None and self._tensors.get(spec.name) is obj:
            return ("var", self._json[spec.name])
        if isinstance(obj, torch.nn.Parameter) and not self._warned_outside_scope:
            self._warned_outside_scope = True
            log.warning(
                "phalanx: a scheduled function uses a parameter %s that was not created in "
                "strategy.scope(): it is copied to the worker with every function and its updates "
                "are lost. Create the model inside `with strategy.scope():`.",
                tuple(obj.shape),
            )
        return None

    @property
    def handles(self) -> list[RemoteVariable | ShardedVariable]:
        """Handles to every variable on the parameter servers, in creation order."""
        return [ShardedVariable(s, self.io) if s.partitioned else RemoteVariable(s, self.io) for s in self.specs]

    def remote_variable(self, tensor: torch.Tensor) -> RemoteVariable | ShardedVariable:
        """The handle of the variable behind one of the chief's parameters or buffers.

        Raises:
            KeyError: ``tensor`` was not created in this strategy's scope.
        """
        spec = self._spec_by_id.get(id(tensor))
        if spec is None or self._tensors.get(spec.name) is not tensor:
            raise KeyError("this tensor is not a variable of the strategy (create it inside strategy.scope())")
        return ShardedVariable(spec, self.io) if spec.partitioned else RemoteVariable(spec, self.io)

    def pull(self, names: Sequence[str] | None = None) -> None:
        """Copies the servers' current values into the chief's tensors (after sending the chief's own changes)."""
        if not self.specs:
            return
        self.push()
        specs = [s for s in self.specs if names is None or s.name in names]
        targets = [self._tensors[s.name] for s in specs]
        self.io.read_into(specs, targets)
        for s, t in zip(specs, targets):
            self._versions[s.name] = version_counter(t)

    def push(self, force: bool = False) -> None:
        """Sends the chief's tensors that changed since they were last synchronised (all with ``force``)."""
        if not self.specs:
            return
        changed = [s for s in self.specs if force or version_counter(self._tensors[s.name]) != self._versions[s.name]]
        if not changed:
            return
        self.io.assign(changed, [self._tensors[s.name] for s in changed])
        for s in changed:
            self._versions[s.name] = version_counter(self._tensors[s.name])

    def variable_json(self, tensor: Any) -> str | None:
        """The wire description of the variable behind ``tensor`` (a chief's tensor), or None if it is not one."""
        spec = self.spec_of(tensor)
        return None if spec is None else self._json[spec.name]

    def spec_of(self, tensor: Any) -> VariableSpec | None:
        spec = self._spec_by_id.get(id(tensor))
        return spec if spec is not None and self._tensors.get(spec.name) is tensor else None

    def optimizer_variables(
        self, optimizer: torch.optim.Optimizer
    ) -> list[tuple[int, torch.Tensor, VariableSpec, dict[str, Any]]]:
        """(index in ``state_dict()``, parameter, spec, group) of the optimizer's trainable PS variables."""
        out, index = [], 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                spec = self.spec_of(p)
                if spec is not None and spec.trainable:
                    out.append((index, p, spec, group))
                index += 1
        return out

    # Checkpoints: optimizer state lives on the servers, so a save fetches it into the optimizer's
    # ordinary ``state_dict`` (restorable under any strategy, or none) and a restore sends it back.
    def state_to_save(self, obj: Any) -> Any:
        if not self.specs:
            return None
        if isinstance(obj, torch.optim.Optimizer):
            found = self.optimizer_variables(obj)
            if not found:
                return None
            state = obj.state_dict()
            for (index, _, _, _), saved in zip(found, self.io.read_optimizer_state([f[2] for f in found])):
                if saved:
                    state["state"][index] = saved
                else:
                    state["state"].pop(index, None)
            return state
        if isinstance(obj, torch.nn.Module) and any(
            self.spec_of(t) is not None for t in [*obj.parameters(), *obj.buffers()]
        ):
            self.pull()  # the chief's copy may lag the servers
        return None

    def after_restore(self, obj: Any) -> None:
        if not self.specs:
            return
        if isinstance(obj, torch.optim.Optimizer):
            from phalanx.ps.worker import optimizer_config

            found = self.optimizer_variables(obj)
            states = [
                {k: v for k, v in obj.state.get(p, {}).items() if isinstance(v, torch.Tensor)} for _, p, _, _ in found
            ]
            configs = [optimizer_config(obj, group) for _, _, _, group in found]
            self.io.assign_optimizer_state([f[2] for f in found], states, configs)
            for _, p, _, _ in found:
                # The servers hold it now; a copy here would also travel with every scheduled function.
                obj.state.pop(p, None)
        elif isinstance(obj, torch.nn.Module):
            self.push()


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()))
