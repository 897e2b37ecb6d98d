"""A parameter server: holds variable shards and applies updates to them as they arrive.

The service has a fixed set of operations and nothing else (gRPC answers any other method name
with ``UNIMPLEMENTED``); none of them deserializes code. Every request must carry the cluster
secret's signature over every byte, and must not be a replay; both are checked before the request
is parsed (:mod:`phalanx.ps.wire`, :class:`phalanx.ps.service.SignedService`).

=========  ===================================================================================
ping       who am I (task, pid, incarnation), how many variables and updates
create     create variables with initial values; an existing one keeps its value
read       current values
assign     overwrite values (the chief restoring a checkpoint, or writing a variable)
add        add deltas atomically (counters, moving statistics changed by a scheduled function)
apply      apply gradients with this server's optimizer for the variable
opt_read   the optimizer state of variables (for checkpoints saved through the chief)
opt_assign set the optimizer state of variables (a checkpoint restored through the chief)
shutdown   stop serving (the coordinator shuts the cluster down)
=========  ===================================================================================

Optimizer state lives here, next to its variable: the first ``apply`` for a variable builds a
``torch.optim`` optimizer of the class the worker's optimizer has (by name, only classes defined
in ``torch.optim``), with that optimizer's hyperparameters; later requests refresh the
hyperparameters (so a learning-rate schedule on the chief reaches the servers). Updates are
asynchronous: each is applied under its variable's lock as soon as it arrives.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch

from phalanx.ps import wire
from phalanx.ps.client import PS_SERVICE
from phalanx.ps.optimizers import SERVER_OPTIMIZERS
from phalanx.ps.service import SignedService
from phalanx.ps.transport import ServiceError

log = logging.getLogger("phalanx.ps")

_REFUSED_OPTIMIZERS = {"LBFGS"}  # needs a closure that re-evaluates the loss: not possible on a server
_MAX_HYPER = 1e300  # a hyperparameter's magnitude: beyond it, a float's arithmetic overflows


def optimizer_class(name: Any) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizer class called ``name``, or one of phalanx's own
    (:data:`phalanx.ps.optimizers.SERVER_OPTIMIZERS`); nothing else is accepted."""
    if isinstance(name, str) and name in SERVER_OPTIMIZERS:
        return SERVER_OPTIMIZERS[name]
    cls = getattr(torch.optim, name, None) if isinstance(name, str) and name.isidentifier() else None
    if (
        not isinstance(cls, type)
        or not issubclass(cls, torch.optim.Optimizer)
        or cls is torch.optim.Optimizer
        or not cls.__module__.startswith("torch.optim")
        or name in _REFUSED_OPTIMIZERS
    ):
        raise ServiceError(
            "invalid",
            f"optimizer {name!r} is not a torch.optim optimizer that a parameter server "
            f"can run (LBFGS and optimizers outside torch.optim are not supported)",
        )
    return cls


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _hyper(config: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's hyperparameters from a request: numbers, flags, None, or lists of numbers.

    Anything else (a string learning rate, an object for a momentum) would reach the optimizer's
    arithmetic as a TypeError; it is refused here, naming the hyperparameter.
    """
    hyper = config.get("hyper", {})
    if not isinstance(hyper, dict):
        raise ServiceError("invalid", f"'hyper' must be an object of hyperparameters; received {hyper!r}")
    for name, value in hyper.items():
        if not (
            value is None
            or isinstance(value, bool)
            or (_is_number(value) and math.isfinite(value))
            or (isinstance(value, list) and all(_is_number(v) and math.isfinite(v) for v in value))
        ):
            raise ServiceError(
                "invalid", f"hyperparameter 'hyper.{name}' must be a number, a flag or a list of numbers; got {value!r}"
            )
    # JSON turns tuples (Adam's betas) into lists; torch.optim wants tuples.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()}


def _typed_like_defaults(
    hyper: dict[str, Any], parameters: Mapping[str, inspect.Parameter], name: str
) -> dict[str, Any]:
    """``hyper`` with each value checked against the kind of the optimizer's default for it.

    A value of another kind (None for a learning rate, a list for a momentum) would pass the
    optimizer's constructor only to fail in its arithmetic at the next step: it is refused,
    naming the hyperparameter. Numbers where the default is a float become floats.
    """
    out = {}
    for key, value in hyper.items():
        param = parameters.get(key)
        default = param.default if param is not None else inspect.Parameter.empty
        ok = True
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif _is_number(default):
            ok = _is_number(value) and abs(value) <= _MAX_HYPER
            if ok and not (isinstance(default, int) and isinstance(value, int) and abs(value) < 2**53):
                value = float(value)  # a huge int does not fit the C types torch converts it to
        elif isinstance(default, tuple):
            ok = (
                isinstance(value, tuple)
                and len(value) == len(default)
                and all(
                    (v is None and d is None) or (_is_number(v) and abs(v) <= _MAX_HYPER)
                    for v, d in zip(value, default)
                )
            )
        elif default is None:
            ok = value is None or isinstance(value, bool)
        if not ok:
            raise ServiceError(
                "invalid",
                f"hyperparameter 'hyper.{key}' of {name} must be like its default {default!r}; got {value!r}",
            )
        out[key] = value
    return out


class _Slot:
    __slots__ = ("lock", "optimizer", "optimizer_class", "updates", "value")

    def __init__(self, value: torch.Tensor, trainable: bool) -> None:
        self.value = torch.nn.Parameter(value, requires_grad=True) if trainable else value
        self.lock = threading.Lock()
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_class = ""
        self.updates = 0

    def configure(self, config: dict[str, Any]) -> torch.optim.Optimizer:
        """This variable's optimizer, built (or rebuilt for another class) and given ``config``'s hyperparameters."""
        if not isinstance(self.value, torch.nn.Parameter):
            raise ServiceError("invalid", "an optimizer for a non-trainable variable")
        name = config.get("class")
        cls = optimizer_class(name)
        accepted = inspect.signature(cls.__init__).parameters
        hyper = _typed_like_defaults(_hyper(config), accepted, name)
        if self.optimizer is None or self.optimizer_class != name:
            try:
                self.optimizer = cls(
                    [self.value], **{k: v for k, v in hyper.items() if k in accepted and k != "params"}
                )
            except (TypeError, ValueError) as e:
                raise ServiceError("invalid", f"cannot build {name}: {e}") from None
            self.optimizer_class = name
        group = self.optimizer.param_groups[0]
        for k, v in hyper.items():
            if k != "params" and k in group:
                group[k] = v
        return self.optimizer

    def apply(self, grad: torch.Tensor, config: dict[str, Any]) -> None:
        if not isinstance(self.value, torch.nn.Parameter):
            raise ServiceError("invalid", "gradient for a non-trainable variable")
        self.configure(config)
        self.value.grad = grad
        self.optimizer.step()
        self.value.grad = None
        self.updates += 1


class ParameterServerService(SignedService):
    """The operations of parameter server ``ps:index``; see the module docstring.

    Args:
        index: this server's task index.
        secret: the cluster secret; requests without its signature are refused and logged.
        on_shutdown: called once when the coordinator asks the server to stop.
    """

    NAME = PS_SERVICE
    METHODS = ("ping", "create", "read", "assign", "add", "apply", "opt_read", "opt_assign", "shutdown")

    def __init__(self, index: int, secret: bytes, on_shutdown: Callable[[], None] | None = None) -> None:
        super().__init__(f"ps:{index}", secret)
        self.index = index
        self.incarnation = uuid.uuid4().hex
        self._on_shutdown = on_shutdown
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------ dispatch
    def _dispatch(self, method: str, msg: wire.Message) -> tuple[dict, list, list]:
        if msg.blobs:
            # No operation of a parameter server takes anything but tensors: nothing is ever unpickled here.
            raise ServiceError("invalid", f"{self.task}: {method!r} takes tensors only; the request carried blobs")
        header, tensors = getattr(self, f"_op_{method}")(msg)
        return header, tensors, []

    def _keys(self, msg: wire.Message, with_tensors: bool = True) -> list[str]:
        keys = msg.header.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ServiceError("invalid", "'keys' must be a list of variable names")
        if with_tensors and len(keys) != len(msg.tensors):
            raise ServiceError("invalid", f"{len(keys)} keys but {len(msg.tensors)} tensors")
        return keys

    def _slot(self, key: str) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            raise ServiceError("not_found", f"{self.task} has no variable {key!r}")
        return slot

    @staticmethod
    def _check(slot: _Slot, key: str, value: torch.Tensor) -> None:
        if value.shape != slot.value.shape or value.dtype != slot.value.dtype:
            raise ServiceError(
                "invalid",
                f"variable {key!r} is {slot.value.dtype} {list(slot.value.shape)}; "
                f"received {value.dtype} {list(value.shape)}",
            )

    # ------------------------------------------------------------------------------ operations
    def _op_ping(self, msg: wire.Message) -> tuple[dict, list]:
        with self._lock:
            updates = sum(s.updates for s in self._slots.values())
            count = len(self._slots)
        return {
            "task": self.task,
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "variables": count,
            "updates": updates,
            "refused": self.refused,
        }, []

    def _op_create(self, msg: wire.Message) -> tuple[dict, list]:
        specs = msg.header.get("vars")
        if not isinstance(specs, list) or len(specs) != len(msg.tensors):
            raise ServiceError("invalid", "'vars' must list one entry per tensor")
        created, existing = [], []
        with self._lock:
            for i, (spec, value) in enumerate(zip(specs, msg.tensors)):
                key = spec.get("key") if isinstance(spec, dict) else None
                if not isinstance(key, str):
                    raise ServiceError("invalid", f"'vars'[{i}] must be an object with a string 'key'; got {spec!r}")
                if key in self._slots:
                    self._check(self._slots[key], key, value)
                    existing.append(key)
                else:
                    self._slots[key] = _Slot(value, bool(spec.get("trainable", False)) and value.is_floating_point())
                    created.append(key)
        return {"created": created, "existing": existing}, []

    def _op_read(self, msg: wire.Message) -> tuple[dict, list]:
        out = []
        for key in self._keys(msg, with_tensors=False):
            slot = self._slot(key)
            with slot.lock:
                out.append(slot.value.detach().clone())
        return {}, out

    def _op_assign(self, msg: wire.Message) -> tuple[dict, list]:
        for key, value in zip(self._keys(msg), msg.tensors):
            slot = self._slot(key)
            self._check(slot, key, value)
            with slot.lock, torch.no_grad():
                slot.value.copy_(value)
        return {}, []

    def _op_add(self, msg: wire.Message) -> tuple[dict, list]:
        for key, delta in zip(self._keys(msg), msg.tensors):
            slot = self._slot(key)
            self._check(slot, key, delta)
            with slot.lock, torch.no_grad():
                slot.value.add_(delta)
        return {}, []

    def _op_apply(self, msg: wire.Message) -> tuple[dict, list]:
        keys = self._keys(msg)
        group_of, optimizers = msg.header.get("group_of"), msg.header.get("optimizers")
        if (
            not isinstance(group_of, list)
            or len(group_of) != len(keys)
            or not isinstance(optimizers, list)
            or not all(_is_number(g) and isinstance(g, int) and 0 <= g < len(optimizers) for g in group_of)
            or not all(isinstance(o, dict) for o in optimizers)
        ):
            raise ServiceError("invalid", "'group_of' must give each key an index into 'optimizers'")
        for key, grad, g in zip(keys, msg.tensors, group_of):
            slot = self._slot(key)
            self._check(slot, key, grad)
            with slot.lock:
                slot.apply(grad, optimizers[g])
        return {}, []

    def _op_opt_read(self, msg: wire.Message) -> tuple[dict, list]:
        states, tensors = [], []
        for key in self._keys(msg, with_tensors=False):
            slot = self._slot(key)
            with slot.lock:
                state = slot.optimizer.state.get(slot.value, {}) if slot.optimizer is not None else {}
                names = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))
                states.append({"class": slot.optimizer_class, "names": names})
                tensors += [state[n].detach().clone() for n in names]
        return {"states": states}, tensors

    def _op_opt_assign(self, msg: wire.Message) -> tuple[dict, list]:
        keys = self._keys(msg, with_tensors=False)
        states, config = msg.header.get("states"), msg.header.get("optimizer")
        if (
            not isinstance(states, list)
            or len(states) != len(keys)
            or not isinstance(config, dict)
            or not all(isinstance(s, list) and all(isinstance(n, str) for n in s) for s in states)
            or sum(len(s) for s in states) != len(msg.tensors)
        ):
            raise ServiceError(
                "invalid",
                f"'states' must list the state names of each of the {len(keys)} 'keys', one tensor per name, "
                "and 'optimizer' its class and hyperparameters",
            )
        offset = 0
        for key, names in zip(keys, states):
            values = msg.tensors[offset : offset + len(names)]
            offset += len(names)
            slot = self._slot(key)
            with slot.lock:
                optimizer = slot.configure(config)
                for name, value in zip(names, values):
                    # Per-element state (momentum, Adam's moments) must fit the variable; scalars (step) may not.
                    if value.dim() > 0 and value.shape != slot.value.shape:
                        raise ServiceError(
                            "invalid",
                            f"optimizer state {name!r} of {key!r} is "
                            f"{list(value.shape)}; the variable is {list(slot.value.shape)}",
                        )
                optimizer.state[slot.value] = {name: value.clone() for name, value in zip(names, values)}
        return {}, []

    def _op_shutdown(self, msg: wire.Message) -> tuple[dict, list]:
        log.info("phalanx %s: shutting down at the coordinator's request", self.task)
        if self._on_shutdown is not None:
            self._on_shutdown()
        return {}, []

    # ------------------------------------------------------------------------------ introspection
    def value(self, key: str) -> torch.Tensor:
        """The current value of ``key`` (for tests and debugging in the server's process)."""
        slot = self._slot(key)
        with slot.lock:
            return slot.value.detach().clone()

    @property
    def keys(self) -> list[str]:
        with self._lock:
            return list(self._slots)
