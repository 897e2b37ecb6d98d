"""A worker: runs the functions the coordinator schedules, against the parameter servers' variables.

For each scheduled function (one at a time):

1. The request's signature (over every byte) and freshness are checked
   (:class:`phalanx.ps.service.SignedService`); only then is the function unpickled. References
   in it resolve to this worker's objects: its copy of each variable, its strategy, its
   per-worker datasets and iterators.
2. The variables the function refers to are refreshed from the parameter servers.
3. The function runs. When it calls ``optimizer.step()`` on an optimizer over those variables, a
   global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``,
   active only while a scheduled function runs) sends the gradients, with the optimizer's class
   name and hyperparameters, to the parameter servers that own them, and drops the local
   ``.grad``: the local step then has nothing to do. Each server applies the update as it arrives;
   no worker waits for another. If the function calls a module again after a step (several
   steps in one function), a global module forward pre-hook first reads the updated variables
   back, so each step sees the servers' current values.
4. Non-trainable variables the function changed in place (a step counter, BatchNorm statistics)
   are sent as deltas (``assign_add``), so concurrent workers' changes add up.
5. The return value (tensors detached) goes back to the coordinator, signed.

What is not supported inside a scheduled function: changing a *trainable* variable in place other
than through ``optimizer.step()`` (logged, not sent), and replacing a variable by a new tensor
(``model.count = model.count + 1``; write ``model.count += 1``).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import os
import threading
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch

from phalanx import hooks, nest
from phalanx._compat.torch import version_counter
from phalanx.ps import pickling, wire
from phalanx.ps.client import WORKER_SERVICE
from phalanx.ps.errors import ParameterServerUnavailableError, ProtocolError
from phalanx.ps.remote_variables import ShardIO, VariableSpec
from phalanx.ps.service import SignedService
from phalanx.ps.transport import ServiceError

log = logging.getLogger("phalanx.ps")

_ACTIVE_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("phalanx_ps_run", default=None)


class MissingResourceError(LookupError):
    """A function refers to a per-worker dataset or iterator this worker has not built."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _SKIP


_SKIP = object()


def optimizer_config(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """What a parameter server needs to build the same optimizer: its torch.optim class and hyperparameters."""
    cls = next(
        (
            c
            for c in type(optimizer).__mro__
            if c.__module__.startswith("torch.optim") and c is not torch.optim.Optimizer
        ),
        type(optimizer),
    )
    if cls is not type(optimizer):
        log.warning(
            "phalanx: %s is applied on the parameter servers as its base class torch.optim.%s",
            type(optimizer).__name__,
            cls.__name__,
        )
    hyper = {}
    for k, v in group.items():
        if k == "params":
            continue
        j = _jsonable(v)
        if j is not _SKIP:  # e.g. a custom object in the group: the server cannot use it
            hyper[k] = j
    return {"class": cls.__name__, "hyper": hyper}


def active_run() -> _Run | None:
    """The scheduled function running in this thread, if any."""
    return _ACTIVE_RUN.get()


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    run = _ACTIVE_RUN.get()
    if run is not None:
        run.service._push_gradients(optimizer)


def _pre_forward(module: torch.nn.Module, args: Any) -> None:
    run = _ACTIVE_RUN.get()
    if run is not None and run.stale:
        run.service._refresh_stale(run)


def _install_step_hook() -> None:
    hooks.install("phalanx.ps.worker.step", "optimizer_step_pre", _pre_step)
    hooks.install("phalanx.ps.worker.forward", "module_forward_pre", _pre_forward)


class _Run:
    """The variables one scheduled function uses, as they were when it started."""

    def __init__(self, service: WorkerService) -> None:
        self.service = service
        self.vars: dict[str, tuple[VariableSpec, torch.Tensor]] = {}
        self.versions: dict[str, int] = {}
        self.snapshots: dict[str, torch.Tensor] = {}
        self.stale: dict[str, tuple[VariableSpec, torch.Tensor]] = {}  # updated on the servers since read


class WorkerService(SignedService):
    """The operations of worker ``worker:index``: ping, resources, run, shutdown.

    Args:
        index, num_workers: this worker's place among the workers.
        strategy: this process's strategy object; a scheduled function's reference to the
            coordinator's strategy resolves to it.
        io: shard I/O to the parameter servers.
        secret: the cluster secret.
    """

    NAME = WORKER_SERVICE
    METHODS = ("ping", "resources", "run", "shutdown")

    def __init__(
        self,
        index: int,
        num_workers: int,
        strategy: Any,
        io: ShardIO,
        secret: bytes,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(f"worker:{index}", secret)
        self.index, self.num_workers = index, num_workers
        self.incarnation = uuid.uuid4().hex
        self._strategy, self._io = strategy, io
        self._on_shutdown = on_shutdown
        self._vars: dict[str, tuple[VariableSpec, torch.Tensor]] = {}
        self._by_id: dict[int, VariableSpec] = {}
        self._specs: dict[str, VariableSpec] = {}  # JSON -> spec cache
        self._resources: dict[str, Any] = {}
        self._run_lock = threading.Lock()
        self._warned: set[str] = set()
        self._extension_state: dict[str, dict[str, Any]] = {}
        self.running = 0
        _install_step_hook()

    # ------------------------------------------------------------------------------ dispatch
    def _dispatch(self, method: str, msg: wire.Message) -> tuple[dict, list, list]:
        try:
            header, blobs = getattr(self, f"_op_{method}")(msg)
        except ProtocolError as e:
            raise ServiceError("invalid", str(e)) from None
        return header, [], blobs

    def _op_ping(self, msg: wire.Message) -> tuple[dict, list]:
        return {
            "task": self.task,
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "resources": len(self._resources),
            "refused": self.refused,
        }, []

    def _op_shutdown(self, msg: wire.Message) -> tuple[dict, list]:
        log.info("phalanx %s: shutting down at the coordinator's request", self.task)
        if self._on_shutdown is not None:
            self._on_shutdown()
        return {}, []

    # ------------------------------------------------------------------------------ references
    def _resolve(self, pid: Any, run: _Run | None) -> Any:
        kind = pid[0] if isinstance(pid, tuple) and pid else None
        if kind == "var":
            spec = self._specs.get(pid[1])
            if spec is None:
                spec = self._specs[pid[1]] = VariableSpec.from_json(pid[1])
            tensor = self._local(spec)
            if run is not None:
                run.vars[spec.name] = (spec, tensor)
            return tensor
        if kind == "strategy":
            return self._strategy
        if kind == "extended":
            return self._strategy.extended
        if kind == "resource":
            try:
                return self._resources[pid[1]]
            except KeyError:
                raise MissingResourceError(pid[1]) from None
        if kind == "none":
            return None
        if kind == pickling.EXTENSION:
            return pickling.resolve_reference(pid, self, run)
        raise ProtocolError(f"unknown reference {pid!r} in a scheduled function")

    # ------------------------------------------------------------------------------ for integrations
    # The operations an integration's references (phalanx.ps.pickling.register_reference) use.
    def adopt(self, spec_json: str, tensor: torch.Tensor) -> None:
        """Makes ``tensor`` (e.g. a Keras variable's own) this worker's copy of the variable ``spec_json``."""
        self._adopt(spec_json, tensor)

    def bind(self, spec_json: str, run: _Run | None) -> torch.Tensor:
        """This worker's copy of the variable ``spec_json``, refreshed from the servers before ``run``."""
        return self._resolve(("var", spec_json), run)

    def push_gradients(self, grads: list[Any], variables: list[torch.Tensor], config: dict[str, Any]) -> None:
        """Sends the gradients of ``variables`` (this worker's copies) to be applied with ``config``'s optimizer."""
        self._push_tensors(grads, variables, config)

    def extension_state(self, key: str) -> dict[str, Any]:
        """A dict an integration keeps on this worker across scheduled functions (e.g. its rebuilt models)."""
        return self._extension_state.setdefault(key, {})

    def _adopt(self, spec_json: str, tensor: torch.Tensor) -> None:
        """Makes ``tensor`` (e.g. a Keras variable's own) this worker's copy of the variable ``spec_json``."""
        spec = self._specs.get(spec_json)
        if spec is None:
            spec = self._specs[spec_json] = VariableSpec.from_json(spec_json)
        old = self._vars.get(spec.name)
        if old is not None:
            self._by_id.pop(id(old[1]), None)
        self._vars[spec.name] = (spec, tensor)
        self._by_id[id(tensor)] = spec

    def _local(self, spec: VariableSpec) -> torch.Tensor:
        entry = self._vars.get(spec.name)
        if entry is not None and entry[0] == spec:
            return entry[1]
        if entry is not None:  # a restarted coordinator re-created the variable differently
            self._by_id.pop(id(entry[1]), None)
        tensor = spec.new_local()
        self._vars[spec.name] = (spec, tensor)
        self._by_id[id(tensor)] = spec
        return tensor

    # ------------------------------------------------------------------------------ resources
    def _op_resources(self, msg: wire.Message) -> tuple[dict, list]:
        with self._run_lock:
            try:
                for item in msg.header.get("resources", []):
                    if item["id"] in self._resources:
                        continue
                    if item["kind"] == "dataset":
                        fn = pickling.loads(msg.blobs[item["blob"]], lambda pid: self._resolve(pid, None))
                        self._resources[item["id"]] = self._call_dataset_fn(fn)
                    elif item["kind"] == "iterator":
                        self._resources[item["id"]] = iter(self._resources[item["dataset"]])
                    else:
                        raise ProtocolError(f"unknown resource kind {item['kind']!r}")
            except MissingResourceError as e:
                return {"status": "error", "kind": "missing_resource", "message": str(e)}, []
            except Exception as e:  # noqa: BLE001 - the user's dataset_fn failed: report it as theirs
                return self._user_error(e)
        return {"status": "ok"}, []

    def _call_dataset_fn(self, fn: Callable[..., Any]) -> Any:
        from phalanx.input.input_context import InputContext

        try:
            params = [
                p
                for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            params = []
        if params:
            return fn(InputContext(self.num_workers, self.index, 1))
        return fn()

    # ------------------------------------------------------------------------------ running functions
    def _op_run(self, msg: wire.Message) -> tuple[dict, list]:
        if len(msg.blobs) != 1:
            raise ServiceError("invalid", "'run' takes exactly one function")
        with self._run_lock:
            self.running += 1
            run = _Run(self)
            try:
                try:
                    fn, args, kwargs = pickling.loads(msg.blobs[0], lambda pid: self._resolve(pid, run))
                except MissingResourceError as e:
                    return {"status": "error", "kind": "missing_resource", "message": str(e)}, []
                self._refresh(run)
                token = _ACTIVE_RUN.set(run)
                try:
                    with self._strategy.scope():
                        result = fn(*args, **kwargs)
                finally:
                    _ACTIVE_RUN.reset(token)
                self._push_deltas(run)
                result = nest.map_structure(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result)
                return {"status": "ok"}, [pickling.dumps(result)]
            except ParameterServerUnavailableError as e:
                return {
                    "status": "error",
                    "kind": "ps_unavailable",
                    "ps": e.index,
                    "address": e.address,
                    "cause": e.cause,
                }, []
            except Exception as e:  # noqa: BLE001 - the user's function failed: the coordinator re-raises it
                return self._user_error(e)
            finally:
                for _, tensor in run.vars.values():
                    tensor.grad = None
                self.running -= 1

    def _user_error(self, e: BaseException) -> tuple[dict, list]:
        text = traceback.format_exc()
        header = {
            "status": "error",
            "kind": "user",
            "type": type(e).__name__,
            "message": str(e),
            "traceback": text,
            "task": self.task,
        }
        try:
            return header, [pickling.dumps(e)]
        except Exception:  # noqa: BLE001 - an exception that cannot be pickled goes back as text
            return header, []

    def _refresh(self, run: _Run) -> None:
        if not run.vars:
            return
        names = list(run.vars)
        self._io.read_into([run.vars[n][0] for n in names], [run.vars[n][1] for n in names])
        for name in names:
            spec, tensor = run.vars[name]
            tensor.grad = None
            run.versions[name] = version_counter(tensor)
            if not spec.trainable and tensor.dtype != torch.bool:
                run.snapshots[name] = tensor.detach().clone()

    def _push_deltas(self, run: _Run) -> None:
        specs, deltas = [], []
        for name, (spec, tensor) in run.vars.items():
            if version_counter(tensor) == run.versions.get(name):
                continue
            if name in run.snapshots:
                delta = tensor.detach() - run.snapshots[name]
                if bool(delta.any()):
                    specs.append(spec)
                    deltas.append(delta)
            elif name not in self._warned:
                self._warned.add(name)
                log.warning(
                    "phalanx %s: variable %s was changed in place by a scheduled function outside "
                    "optimizer.step(); the change stays on this worker",
                    self.task,
                    name,
                )
        if specs:
            self._io.add(specs, deltas)

    def _push_tensors(self, grads: list[Any], variables: list[torch.Tensor], config: dict[str, Any]) -> None:
        """Sends the gradients of ``variables`` (this worker's copies) to be applied with ``config``'s optimizer."""
        specs, sent, pushed = [], [], []
        for g, v in zip(grads, variables):
            spec = self._by_id.get(id(v))
            if g is None or spec is None or not spec.trainable:
                continue
            specs.append(spec)
            sent.append(g.to_dense() if g.is_sparse else g)
            pushed.append(v)
        if specs:
            self._io.apply(specs, sent, [0] * len(specs), [config])
        self._mark_stale(specs, pushed)

    def _mark_stale(self, specs: list[VariableSpec], pushed: list[torch.Tensor]) -> None:
        run = _ACTIVE_RUN.get()
        for spec, p in zip(specs, pushed):
            p.grad = None  # the local step has nothing left to do for this parameter
            if run is not None:
                run.stale[spec.name] = (spec, p)

    def _push_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        specs, grads, groups, configs, pushed = [], [], [], [], []
        for group in optimizer.param_groups:
            config_index = None
            for p in group["params"]:
                spec = self._by_id.get(id(p))
                if spec is None or p.grad is None or not spec.trainable:
                    continue
                if config_index is None:
                    configs.append(optimizer_config(optimizer, group))
                    config_index = len(configs) - 1
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                specs.append(spec)
                grads.append(grad)
                groups.append(config_index)
                pushed.append(p)
        if specs:
            self._io.apply(specs, grads, groups, configs)
        self._mark_stale(specs, pushed)

    def _refresh_stale(self, run: _Run) -> None:
        """Reads back the variables this function updated, before it uses them again (a second step)."""
        stale, run.stale = list(run.stale.values()), {}
        self._io.read_into([spec for spec, _ in stale], [t for _, t in stale])
        for spec, tensor in stale:
            run.versions[spec.name] = version_counter(tensor)
