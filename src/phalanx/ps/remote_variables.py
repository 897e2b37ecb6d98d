"""Variables that live on parameter servers: their layout, the handles, and the shard I/O.

Each variable created in ``ParameterServerStrategy.scope()`` gets a :class:`VariableSpec`: a name,
its shape and dtype, and its shards. An unpartitioned variable is one shard holding all of it
(``rows == -1``); a partitioned one is split along dimension 0 into consecutive row ranges, each on
a parameter server (round robin). The chief and the workers keep ordinary full tensors (the
module's parameters); only the parameter servers hold shards. :class:`ShardIO` moves values
between the two: one request per parameter server, all servers at once.

:class:`RemoteVariable` and :class:`ShardedVariable` are the chief's handles to read or assign a
variable on the servers directly.

Example:
    >>> import torch
    >>> spec = VariableSpec("v0", (5, 2), "float32", True, "parameter",
    ...                     (Shard(0, "v0/part_0", 0, 3), Shard(1, "v0/part_1", 3, 2)))
    >>> value = torch.arange(10.).reshape(5, 2)
    >>> [p.shape[0] for p in split_value(value, spec)]
    [3, 2]
    >>> torch.equal(join_values(split_value(value, spec), spec), value)
    True
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.ps import wire
from phalanx.ps.client import RemoteTask, call_all
from phalanx.ps.errors import VariableError, task_device


@dataclass(frozen=True)
class Shard:
    """Rows ``start .. start + rows`` of a variable, stored as ``key`` on parameter server ``ps``.

    ``rows == -1``: the whole variable (unpartitioned, or a scalar).
    """

    ps: int
    key: str
    start: int
    rows: int


@dataclass(frozen=True)
class VariableSpec:
    """Where a variable lives and what it is."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    kind: str  # "parameter" or "buffer"
    shards: tuple[Shard, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return wire.dtype_from_name(self.dtype)

    @property
    def partitioned(self) -> bool:
        return len(self.shards) > 1

    def to_json(self) -> str:
        return json.dumps(
            [
                self.name,
                list(self.shape),
                self.dtype,
                self.trainable,
                self.kind,
                [[s.ps, s.key, s.start, s.rows] for s in self.shards],
            ],
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> VariableSpec:
        name, shape, dtype, trainable, kind, shards = json.loads(text)
        return cls(name, tuple(shape), dtype, bool(trainable), kind, tuple(Shard(*s) for s in shards))

    def new_local(self) -> torch.Tensor:
        """An uninitialised local tensor of this variable (a Parameter for parameters)."""
        t = torch.empty(self.shape, dtype=self.torch_dtype)
        if self.kind == "parameter":
            return torch.nn.Parameter(t, requires_grad=self.trainable)
        return t


def shard_view(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The part of the full ``tensor`` that ``shard`` holds (a view)."""
    return tensor if shard.rows < 0 else tensor.narrow(0, shard.start, shard.rows)


def split_value(value: torch.Tensor, spec: VariableSpec) -> list[torch.Tensor]:
    """The shards of a full value, in shard order (views, no copy)."""
    if tuple(value.shape) != spec.shape:
        raise VariableError(f"variable {spec.name!r} has shape {list(spec.shape)}; received {list(value.shape)}")
    return [shard_view(value, s) for s in spec.shards]


def join_values(parts: Sequence[torch.Tensor], spec: VariableSpec) -> torch.Tensor:
    """The full value from its shards (the inverse of :func:`split_value`)."""
    if not spec.partitioned:
        return parts[0].reshape(spec.shape)
    return torch.cat(list(parts), dim=0)


class ShardIO:
    """Reads and writes variables' shards on the parameter servers (``tasks[i]`` is ``ps:i``)."""

    def __init__(self, tasks: Sequence[RemoteTask]) -> None:
        self.tasks = list(tasks)

    def _by_ps(self, specs: Sequence[VariableSpec]) -> dict[int, list[tuple[int, int]]]:
        groups: dict[int, list[tuple[int, int]]] = {}
        for i, spec in enumerate(specs):
            for j, shard in enumerate(spec.shards):
                groups.setdefault(shard.ps, []).append((i, j))
        return groups

    def create(self, specs: Sequence[VariableSpec], values: Sequence[torch.Tensor]) -> set[str]:
        """Creates the variables with these initial values; returns the names that already existed
        (a restarted coordinator finds its variables still on live servers: they keep their values)."""
        groups = self._by_ps(specs)
        calls = []
        for ps, items in groups.items():
            header = {"vars": [{"key": specs[i].shards[j].key, "trainable": specs[i].trainable} for i, j in items]}
            tensors = [shard_view(values[i].detach(), specs[i].shards[j]) for i, j in items]
            calls.append((self.tasks[ps], "create", header, tensors))
        existing: set[str] = set()
        for (_, items), reply in zip(groups.items(), call_all(calls)):
            found = set(reply.header.get("existing", []))
            existing |= {specs[i].name for i, j in items if specs[i].shards[j].key in found}
        return existing

    def read_into(self, specs: Sequence[VariableSpec], targets: Sequence[torch.Tensor]) -> None:
        """Copies the servers' current values into ``targets`` (full local tensors), in place."""
        groups = self._by_ps(specs)
        calls = [
            (self.tasks[ps], "read", {"keys": [specs[i].shards[j].key for i, j in items]}, [])
            for ps, items in groups.items()
        ]
        with torch.no_grad():
            for (_, items), reply in zip(groups.items(), call_all(calls)):
                for (i, j), value in zip(items, reply.tensors):
                    dst = shard_view(targets[i].data, specs[i].shards[j])
                    dst.copy_(value.reshape(dst.shape))

    def read(self, specs: Sequence[VariableSpec]) -> list[torch.Tensor]:
        """The servers' current values, as new full tensors."""
        out = [torch.empty(s.shape, dtype=s.torch_dtype) for s in specs]
        self.read_into(specs, out)
        return out

    def _write(
        self,
        method: str,
        specs: Sequence[VariableSpec],
        values: Sequence[torch.Tensor],
        extra: dict[str, Any] | None = None,
    ) -> None:
        groups = self._by_ps(specs)
        calls = []
        for ps, items in groups.items():
            header = {"keys": [specs[i].shards[j].key for i, j in items], **(extra or {})}
            calls.append(
                (self.tasks[ps], method, header, [shard_view(values[i].detach(), specs[i].shards[j]) for i, j in items])
            )
        if calls:
            call_all(calls)

    def assign(self, specs: Sequence[VariableSpec], values: Sequence[torch.Tensor]) -> None:
        """Overwrites the variables on the servers."""
        self._write("assign", specs, values)

    def add(self, specs: Sequence[VariableSpec], deltas: Sequence[torch.Tensor]) -> None:
        """Adds ``deltas`` on the servers, atomically per shard (``assign_add``)."""
        self._write("add", specs, deltas)

    def apply(
        self,
        specs: Sequence[VariableSpec],
        grads: Sequence[torch.Tensor],
        groups: Sequence[int],
        optimizers: Sequence[dict[str, Any]],
    ) -> None:
        """Sends gradients; each server applies them with its optimizer (``optimizers[groups[i]]``)."""
        by_ps = self._by_ps(specs)
        calls = []
        for ps, items in by_ps.items():
            used = sorted({groups[i] for i, _ in items})
            header = {
                "keys": [specs[i].shards[j].key for i, j in items],
                "group_of": [used.index(groups[i]) for i, _ in items],
                "optimizers": [optimizers[g] for g in used],
            }
            calls.append(
                (self.tasks[ps], "apply", header, [shard_view(grads[i], specs[i].shards[j]) for i, j in items])
            )
        if calls:
            call_all(calls)

    def read_optimizer_state(self, specs: Sequence[VariableSpec]) -> list[dict[str, torch.Tensor]]:
        """Each variable's optimizer state on the servers, joined over its shards ({} before any update).

        Per-element tensors (momentum, Adam's moments) are concatenated like the variable; scalars
        (Adam's ``step``) are taken from the first shard (every update reaches all shards).
        """
        groups = self._by_ps(specs)
        calls = [
            (self.tasks[ps], "opt_read", {"keys": [specs[i].shards[j].key for i, j in items]}, [])
            for ps, items in groups.items()
        ]
        parts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for (_, items), reply in zip(groups.items(), call_all(calls)):
            tensors = iter(reply.tensors)
            for (i, j), state in zip(items, reply.header["states"]):
                parts[(i, j)] = {name: next(tensors) for name in state["names"]}
        out = []
        for i, spec in enumerate(specs):
            shards = [parts[(i, j)] for j in range(len(spec.shards))]
            state: dict[str, torch.Tensor] = {}
            for name, first in shards[0].items():
                if first.dim() > 0 and spec.partitioned and all(name in s for s in shards):
                    state[name] = torch.cat([s[name] for s in shards], dim=0)
                else:
                    state[name] = first.reshape(spec.shape) if first.dim() > 0 else first
            out.append(state)
        return out

    def assign_optimizer_state(
        self,
        specs: Sequence[VariableSpec],
        states: Sequence[dict[str, torch.Tensor]],
        configs: Sequence[dict[str, Any]],
    ) -> None:
        """Sets each variable's optimizer state on the servers (split over its shards like the variable).

        ``configs[i]`` (the optimizer's class and hyperparameters, as ``apply`` sends them) builds
        the server's optimizer if the variable has none yet.
        """
        groups = self._by_ps(specs)
        calls = []
        for ps, items in groups.items():
            for i, j in items:  # one call per shard: each may come from an optimizer of another group
                names = sorted(states[i])
                tensors = [
                    shard_view(states[i][n].detach(), specs[i].shards[j])
                    if states[i][n].dim() > 0 and tuple(states[i][n].shape) == specs[i].shape
                    else states[i][n].detach()
                    for n in names
                ]
                calls.append(
                    (
                        self.tasks[ps],
                        "opt_assign",
                        {"keys": [specs[i].shards[j].key], "states": [names], "optimizer": configs[i]},
                        tensors,
                    )
                )
        if calls:
            call_all(calls)


class RemoteVariable:
    """The chief's handle to one variable (or one shard) on a parameter server.

    Attributes:
        name: the variable's name (``"v3"``; shards ``"v3/part_1"``).
        device: its parameter server, e.g. ``/job:ps/replica:0/task:1/device:CPU:0``.
    """

    def __init__(self, spec: VariableSpec, io: ShardIO) -> None:
        self._spec, self._io = spec, io
        shard = spec.shards[0]
        self.name = shard.key
        self.device = f"{task_device('ps', shard.ps)}/device:CPU:0"

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._spec.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._spec.torch_dtype

    def read_value(self) -> torch.Tensor:
        """The current value on the parameter server."""
        return self._io.read([self._spec])[0]

    def assign(self, value: Any) -> None:
        """Overwrites the value on the parameter server."""
        self._io.assign([self._spec], [torch.as_tensor(value, dtype=self.dtype).reshape(self._spec.shape)])

    def __repr__(self) -> str:
        return (
            f"RemoteVariable(name={self.name!r}, shape={list(self.shape)}, dtype={self.dtype}, device={self.device!r})"
        )


class ShardedVariable:
    """A variable split along dimension 0 over several parameter servers (``tf.distribute.ShardedVariable``).

    ``variables`` are the shards (each a :class:`RemoteVariable`); ``read_value()`` joins them and
    ``assign(value)`` splits ``value`` over them. Checkpoints store the joined value and split it
    again on restore, into however many shards the restoring job has.
    """

    def __init__(self, spec: VariableSpec, io: ShardIO) -> None:
        self._spec, self._io = spec, io
        self.name = spec.name
        self.variables = [
            RemoteVariable(
                VariableSpec(
                    s.key,
                    (s.rows, *spec.shape[1:]),
                    spec.dtype,
                    spec.trainable,
                    spec.kind,
                    (Shard(s.ps, s.key, 0, -1),),
                ),
                io,
            )
            for s in spec.shards
        ]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._spec.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._spec.torch_dtype

    def __len__(self) -> int:
        return self._spec.shape[0]

    def read_value(self) -> torch.Tensor:
        """The full value: every shard fetched and joined."""
        return self._io.read([self._spec])[0]

    def assign(self, value: Any) -> None:
        """Splits ``value`` into the shards and writes each to its parameter server."""
        self._io.assign([self._spec], [torch.as_tensor(value, dtype=self.dtype).reshape(self._spec.shape)])

    # Checkpoint protocol (phalanx.checkpoint.sharded_variables): stored as one full tensor.
    def _phalanx_full_tensor_(self) -> torch.Tensor:
        return self.read_value()

    def _phalanx_assign_full_(self, value: torch.Tensor) -> None:
        self.assign(value)

    def _phalanx_layout_(self) -> dict:
        return {"axis": 0, "shards": [v.shape[0] for v in self.variables]}

    def __repr__(self) -> str:
        return (
            f"ShardedVariable(name={self.name!r}, shape={list(self.shape)}, dtype={self.dtype}, "
            f"shards={[v.shape[0] for v in self.variables]})"
        )
