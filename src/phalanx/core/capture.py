"""Capturing the parameters and buffers created inside ``strategy.scope()``.

torch calls a global *registration hook* whenever a module registers a parameter, buffer or
sub-module; plain ``nn.Module`` subclasses and Keras-on-torch layers both go through it. phalanx
installs three such hooks (through :mod:`phalanx.hooks`), at the first capture, and they act only
while a capture is active in the current thread (a context variable says which), and only for
modules created under that capture's strategy. Nothing is monkey-patched and nothing outside a
scope is touched.

Some parameters come into being without a registration: ``copy.deepcopy`` copies a module's
tensors directly (``nn.TransformerEncoder`` and ``nn.Transformer`` deep-copy their layers), and
``to_empty`` writes new ones into a module's table (``torch.func.functional_call``'s stand-ins,
plain tensors put there for one call, are the caller's, not variables). So the modules a
capture saw (each that registered a tensor or was registered as a sub-module under it) are
remembered, weakly, with the capture that saw them, and :func:`capture_modules` adopts whatever
they and their sub-modules hold that nobody captured yet; the strategy calls it at scope exit
and before a ``run`` that follows new modules (nothing to do otherwise). A module so remembered
keeps its tensors captured when a registration replaces them later, outside the scope
(``load_state_dict(assign=True)``, a parameter added afterwards). Meta tensors (no values yet)
are left alone until they are materialised.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from phalanx import hooks
from phalanx.core import context, integrations
from phalanx.errors import KerasIntegrationError


@dataclass(frozen=True)
class Capture:
    """What a capture does: whose scope it is, where tensors go, whom to tell."""

    owner: object
    device: torch.device
    on_parameter: Callable[[torch.nn.Parameter], None]
    on_buffer: Callable[[torch.Tensor], None]
    # Told of each module that registers a tensor (deep=False: its own tensors to sweep) or is
    # registered as a sub-module (deep=True: with its sub-modules) under the capture, and later of
    # such a module (or a container that got sub-modules under it) registering a tensor outside it.
    on_module: Callable[[torch.nn.Module, bool], None] | None = None
    # Written into each remembered module's __dict__ (MARK): a copy.deepcopy of the module carries
    # it (an int: deep-copied and pickled as itself), so the strategy recognises a standalone copy
    # of one of its modules at the first step that calls it (TF mirrors a copied variable too).
    # The one fact phalanx writes on a user's object rather than in a side table (_sidetable): a
    # side table, keyed by identity, does not follow the object into its copy.
    tag: int = 0
    # Told of each container a module is registered on under the capture (a model whose __init__
    # runs in scope): a strategy that works on whole models (FullyShardedStrategy) finds its roots.
    on_container: Callable[[torch.nn.Module], None] | None = None
    # Told of a lazy module (torch.nn.LazyLinear, ...) whose parameters its first forward has just
    # materialised, before that forward uses them: inside `run` they are synchronised at once.
    on_materialized: Callable[[torch.nn.Module], None] | None = None
    # Captures what the modules seen so far hold that nobody captured yet (capture_modules): run
    # before the first call of a module whose host-made parameters wait for the sweep (_defer).
    sweep: Callable[[], None] | None = None


MARK = "_phalanx_scope_tag"


def copied_from_scope(module: torch.nn.Module, tag: int) -> bool:
    """Whether ``module`` is (a copy of) a module remembered by the capture tagged ``tag``."""
    return tag != 0 and module.__dict__.get(MARK) == tag


# Keyed by identity: a WeakKeyDictionary would compare tensors with ==, elementwise.
_LABELS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def label_of(param: torch.Tensor) -> str:
    """A readable name for a captured parameter: ``"Linear.weight (shape (128, 784))"``."""
    name = _LABELS.get(param, "parameter")
    return f"{name} (shape {tuple(param.shape)})"


_ACTIVE: contextvars.ContextVar[Capture | None] = contextvars.ContextVar("phalanx_capture", default=None)
# True while capture_modules writes moved tensors back into a module: its own registrations.
_SWEEPING: contextvars.ContextVar[bool] = contextvars.ContextVar("phalanx_sweeping", default=False)
# module -> a weak reference to the `on_module` of the capture that saw it (weak both ways: a
# module does not keep a strategy alive, nor a strategy a module).
_MODULES: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _remember(module: torch.nn.Module, cap: Capture, deep: bool | None = False) -> None:
    """Remembers ``module`` as ``cap``'s and, unless ``deep`` is None, tells ``cap`` to sweep it."""
    if cap.on_module is None:
        return
    if cap.tag:
        module.__dict__[MARK] = cap.tag  # not setattr: a Keras layer would track the attribute
    _MODULES[module] = weakref.WeakMethod(cap.on_module)  # type: ignore[arg-type]
    if deep is not None:
        cap.on_module(module, deep)


def _seen_before(module: torch.nn.Module) -> None:
    """A module some capture saw registers a tensor outside it: that capture's owner sweeps the
    module's own tensors (not its sub-modules: one created outside a scope is not the scope's)."""
    ref = _MODULES.get(module)
    notify = ref() if ref is not None else None
    if notify is not None:
        notify(module, False)


def _current() -> Capture | None:
    cap = _ACTIVE.get()
    return cap if cap is not None and context.get_strategy() is cap.owner else None


def _is_compiler_module(module: torch.nn.Module) -> bool:
    # torch.compile builds fx GraphModules while it compiles a replica function; what they
    # register are the user's own (already synchronised) tensors or constants, and whether a
    # graph is built at all may differ between replicas (the chief's optimizer step is not the
    # others' under CentralStorage): capturing them would make replicas broadcast different sets.
    return isinstance(module, torch.fx.GraphModule) or torch.compiler.is_compiling()


def _check_keras_integration(module: torch.nn.Module) -> None:
    # The core never imports Keras; a Keras layer built in scope without phalanx.keras would train
    # undistributed and wrong, silently. Scope entry activates the integration when Keras is
    # loaded (phalanx.core.integrations); Keras imported inside the scope is caught here. Keras
    # registers its variables from its own code (through a ParameterDict on the layer), so look
    # for a Keras frame among the callers.
    if "keras" not in sys.modules or "phalanx.keras" in sys.modules:
        return
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return
        if frame.f_globals.get("__name__", "").startswith("keras."):
            # Joins the current scope on import; an unsupported Keras raises its typed error.
            integrations.activate_loaded(force=True)
            if "phalanx.keras" not in sys.modules:  # pragma: no cover - the import above either works or raises
                raise KerasIntegrationError(frame.f_locals.get("self", module))
            return
        frame = frame.f_back


def _on_param(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None):
    if _SWEEPING.get() or param is None:
        return None
    cap = _current()
    if cap is None:
        _seen_before(module)
        return None
    if _is_compiler_module(module):
        return None
    _check_keras_integration(module)
    _remember(module, cap)
    if param.is_meta:
        return None  # no values to move or broadcast yet: captured once materialised (to_empty, assign)
    if is_lazy(param):
        _watch_materialisation(module, cap)
        return None  # a lazy module's: captured once its first forward gives it a shape
    if param.device != cap.device:
        if param.device.type == "cpu" and context.get_replica_context() is None:
            # Made on the host in scope: moved at the sweep (scope exit, the next `run`, or this
            # module's first call), not now. A module registers a parameter before it draws the
            # initial values (nn.Linear's reset_parameters runs after `self.weight = ...`): moved
            # now, they would come from the device's generator, not from the CPU's, as the same
            # program on a CPU and plain `Model().to("cuda")` draw them (issue 44).
            _defer(module, cap)
            return None
        param = torch.nn.Parameter(param.detach().to(cap.device), requires_grad=param.requires_grad)
        _LABELS[param] = f"{type(module).__name__}.{name}"
        cap.on_parameter(param)
        return param
    _LABELS[param] = f"{type(module).__name__}.{name}"
    cap.on_parameter(param)
    return None


_DEFERRED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # module -> its forward pre-hook's handle


def _defer(module: torch.nn.Module, cap: Capture) -> None:
    """Leaves ``module``'s new host parameter where it was made until the sweep moves it, and
    sweeps before the module's first call if that comes first (a model called inside its scope).
    The module is remembered already (``_remember``): the sweep finds the parameter uncaptured.
    Weak on the capture's callback: the module does not keep its strategy alive."""
    if cap.sweep is None or module in _DEFERRED:
        return
    sweep = weakref.WeakMethod(cap.sweep)  # type: ignore[arg-type]

    def before_call(mod: torch.nn.Module, args: Any) -> None:
        handle = _DEFERRED.pop(mod, None)
        if handle is not None:
            handle.remove()
        callback = sweep()
        if callback is not None:
            callback()

    _DEFERRED[module] = module.register_forward_pre_hook(before_call)


def _on_buffer(module: torch.nn.Module, name: str, buffer: torch.Tensor | None):
    if _SWEEPING.get() or buffer is None:
        return None
    cap = _current()
    if cap is None:
        _seen_before(module)
        return None
    if _is_compiler_module(module):
        return None
    _remember(module, cap)
    if buffer.is_meta or is_lazy(buffer):
        return None
    moved = buffer.to(cap.device) if buffer.device != cap.device else buffer
    cap.on_buffer(moved)
    return moved if moved is not buffer else None


def _on_module(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None):
    # A sub-module registered in scope (a deep copy put in a container, as nn.TransformerEncoder
    # does) may hold tensors no registration announced: remember it for the sweep. One created
    # outside the scope and attached later is not the scope's (its own registrations say so).
    if _SWEEPING.get() or submodule is None:
        return None
    cap = _current()
    if cap is not None and not _is_compiler_module(submodule) and not _is_compiler_module(module):
        _remember(submodule, cap, deep=True)
        # The container (a model whose __init__ runs in scope) keeps what it is given later, as
        # a module that registered a tensor does (a parameter added after the scope).
        _remember(module, cap, deep=None)
        if cap.on_container is not None:
            cap.on_container(module)
    return None


def _install() -> None:
    hooks.install("phalanx.core.capture.parameter", "module_parameter_registration", _on_param)
    hooks.install("phalanx.core.capture.buffer", "module_buffer_registration", _on_buffer)
    hooks.install("phalanx.core.capture.module", "module_module_registration", _on_module)


def capture_modules(
    modules: Iterable[tuple[torch.nn.Module, bool]], cap: Capture, known: Callable[[torch.Tensor], bool]
) -> list[torch.nn.Module]:
    """Captures what ``modules`` and their sub-modules hold that no capture has seen.

    Each parameter or buffer for which ``known`` is false is moved to ``cap.device`` (written back
    into its module) and given to ``cap.on_parameter`` / ``cap.on_buffer``, in module order, so
    every replica captures the same tensors in the same order. Called by the strategy at scope
    exit and before a ``run`` that follows new modules; a collective only through what the
    callbacks do later (the strategy broadcasts the captured tensors).

    Args:
        modules: ``(module, deep)`` as ``cap.on_module`` was told of them; ``deep``: with the
            module's sub-modules.
        cap: whose tensors they become.
        known: whether a tensor is captured already.

    Returns:
        The modules that still hold meta tensors (materialised later by ``to_empty`` or
        ``load_state_dict(assign=True)``): to sweep again.
    """
    unfinished: list[torch.nn.Module] = []
    seen: set[int] = set()
    ref = weakref.WeakMethod(cap.on_module) if cap.on_module is not None else None  # type: ignore[arg-type]
    token = _SWEEPING.set(True)
    try:
        for root, deep in modules:
            for module in root.modules() if deep else (root,):
                if id(module) in seen or _is_compiler_module(module):
                    continue
                seen.add(id(module))
                handle = _DEFERRED.pop(module, None)  # swept now: its first call need not sweep
                if handle is not None:
                    handle.remove()
                if ref is not None:
                    _MODULES[module] = ref
                if _adopt_tensors(module, cap, known):
                    unfinished.append(module)
    finally:
        _SWEEPING.reset(token)
    return unfinished


def _adopt_tensors(module: torch.nn.Module, cap: Capture, known: Callable[[torch.Tensor], bool]) -> bool:
    """Captures ``module``'s own new tensors; True if some are still on the meta device."""
    meta = False
    for name, param in list(module.named_parameters(recurse=False)):
        # A plain tensor in a parameter's place is torch.func.functional_call's stand-in, not a variable.
        if not isinstance(param, torch.nn.Parameter) or known(param):
            continue
        if param.is_meta or is_lazy(param):
            meta = True
            continue
        if param.device != cap.device:
            # In place (as Module.to does): an optimizer made in scope holds this very parameter.
            param.data = param.data.to(cap.device)
        _LABELS[param] = f"{type(module).__name__}.{name}"
        cap.on_parameter(param)
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer is None or known(buffer):
            continue
        if buffer.is_meta or is_lazy(buffer):
            meta = True
            continue
        if buffer.device != cap.device:
            buffer = buffer.to(cap.device)
            setattr(module, name, buffer)
        cap.on_buffer(buffer)
    return meta


_LAZY_WATCHED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # lazy module -> its hook's handle


def _watch_materialisation(module: torch.nn.Module, cap: Capture) -> None:
    """Tells ``cap`` when ``module``'s first forward has materialised its lazy parameters.

    torch's lazy modules (``LazyModuleMixin``) materialise in a forward pre-hook of their own; this
    one, registered after it, runs next, before the forward uses the values. Weak on the capture's
    callback: the module does not keep its strategy alive.
    """
    if cap.on_materialized is None or module in _LAZY_WATCHED:
        return
    notify = weakref.WeakMethod(cap.on_materialized)  # type: ignore[arg-type]

    def materialised(mod: torch.nn.Module, args: Any) -> None:
        if any(is_lazy(p) for p in mod.parameters(recurse=False)):
            return
        handle = _LAZY_WATCHED.pop(mod, None)
        if handle is not None:
            handle.remove()
        callback = notify()
        if callback is not None:
            callback(mod)

    _LAZY_WATCHED[module] = module.register_forward_pre_hook(materialised)


def is_lazy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a lazy module's parameter or buffer that has no shape or values yet."""
    return isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin)


@contextlib.contextmanager
def not_captured() -> Iterator[None]:
    """Registrations inside are not new variables of any scope (a library re-registering the
    variables of a model already captured, as FSDP2's ``fully_shard`` does)."""
    token = _SWEEPING.set(True)
    try:
        yield
    finally:
        _SWEEPING.reset(token)


class capture:  # lower case: used like a function, ``with capture(spec):``
    """Calls ``spec.on_parameter`` / ``spec.on_buffer`` for every tensor registered under
    ``spec.owner``'s scope, moving it to ``spec.device`` first if it was made elsewhere.

    Tensors are made where the program makes them (the CPU, by default) and moved: a model built
    in a GPU replica's scope draws its initial values from the CPU generator, as the same program
    does on a CPU and as ``Model().to("cuda")`` does, so the same seed gives the same weights
    everywhere. A program that wants a large model made on the device (faster, and no host copy)
    says so with torch's own idiom, ``with strategy.scope(), torch.device(strategy.extended.device):``
    (values then come from the device's generator), or builds it on ``meta`` and materialises it
    (``to_empty``), as FSDP does. A class rather than a ``@contextmanager`` generator because
    ``strategy.run`` enters a capture on every step.
    """

    __slots__ = ("_spec", "_token")

    def __init__(self, spec: Capture) -> None:
        self._spec = spec

    def __enter__(self) -> None:
        _install()
        self._token = _ACTIVE.set(self._spec)

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self._token)
