"""Capturing the parameters and buffers created inside ``strategy.scope()``.

torch calls a global *registration hook* whenever a module registers a parameter or buffer;
plain ``nn.Module`` subclasses and Keras-on-torch layers both go through it. phalanx installs
one pair of such hooks (through :mod:`phalanx.hooks`), at the first capture, and they act only
while a capture is active in the current thread
(a context variable says which), and only for modules created under that capture's strategy.
Nothing is monkey-patched and nothing outside a scope is touched.
"""

from __future__ import annotations

import contextvars
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from phalanx import _integrations, context, hooks
from phalanx.errors import KerasIntegrationError


@dataclass(frozen=True)
class Capture:
    """What a capture does: whose scope it is, where tensors go, whom to tell."""

    owner: object
    device: torch.device
    on_parameter: Callable[[torch.nn.Parameter], None]
    on_buffer: Callable[[torch.Tensor], None]


# Keyed by identity: a WeakKeyDictionary would compare tensors with ==, elementwise.
_LABELS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def label_of(param: torch.Tensor) -> str:
    """A readable name for a captured parameter: ``"Linear.weight (shape (128, 784))"``."""
    name = _LABELS.get(param, "parameter")
    return f"{name} (shape {tuple(param.shape)})"


_ACTIVE: contextvars.ContextVar[Capture | None] = contextvars.ContextVar("phalanx_capture", default=None)


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
    # loaded (phalanx._integrations); Keras imported inside the scope is caught here. Keras
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
            _integrations.activate_loaded(force=True)
            if "phalanx.keras" not in sys.modules:  # pragma: no cover - the import above either works or raises
                raise KerasIntegrationError(frame.f_locals.get("self", module))
            return
        frame = frame.f_back


def _on_param(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None):
    cap = _current()
    if cap is None or param is None or _is_compiler_module(module):
        return None
    _check_keras_integration(module)
    if param.device != cap.device:
        param = torch.nn.Parameter(param.detach().to(cap.device), requires_grad=param.requires_grad)
        _LABELS[param] = f"{type(module).__name__}.{name}"
        cap.on_parameter(param)
        return param
    _LABELS[param] = f"{type(module).__name__}.{name}"
    cap.on_parameter(param)
    return None


def _on_buffer(module: torch.nn.Module, name: str, buffer: torch.Tensor | None):
    cap = _current()
    if cap is None or buffer is None or _is_compiler_module(module):
        return None
    moved = buffer.to(cap.device) if buffer.device != cap.device else buffer
    cap.on_buffer(moved)
    return moved if moved is not buffer else None


def _install() -> None:
    hooks.install("phalanx.variables.parameter", "module_parameter_registration", _on_param)
    hooks.install("phalanx.variables.buffer", "module_buffer_registration", _on_buffer)


class capture:  # lower case: used like a function, ``with capture(spec):``
    """Calls ``spec.on_parameter`` / ``spec.on_buffer`` for every tensor registered under
    ``spec.owner``'s scope.

    With ``default_device`` (``scope()``), tensors are created on ``spec.device`` (``torch.device``
    as a context manager sets the default device for factory functions); in every case, parameters
    and buffers registered elsewhere are moved there. A class rather than a ``@contextmanager``
    generator because ``strategy.run`` enters a capture on every step.
    """

    __slots__ = ("_spec", "_device", "_token")

    def __init__(self, spec: Capture, default_device: bool = True) -> None:
        self._spec = spec
        # The default-device mode intercepts every torch call: on the CPU it would only cost time,
        # and inside every `run` it cost a GPU step 25-35 % (small CNN on an H100, measured), so
        # `run` relies on the registration hooks alone to place new parameters and buffers.
        self._device = torch.device(spec.device) if spec.device.type != "cpu" and default_device else None

    def __enter__(self) -> None:
        _install()
        self._token = _ACTIVE.set(self._spec)
        if self._device is not None:
            try:
                self._device.__enter__()
            except BaseException:
                _ACTIVE.reset(self._token)
                raise

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._device is not None:
                self._device.__exit__(*exc)
        finally:
            _ACTIVE.reset(self._token)
