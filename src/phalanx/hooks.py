"""The process-global torch hooks phalanx installs: installed, listed and removed in one place.

torch offers global extension points that phalanx's implicit, TF-style capture needs: module
parameter/buffer/sub-module registration hooks (variable capture, Keras model discovery), the
module forward pre-hook and the optimizer step pre-hook (parameter-server workers). Each is
installed here, once per name, lazily (by the first scope, the first worker service, ...), and
each acts only while phalanx's own context says so; the hook functions live with the feature.
:func:`installed` lists them (a test can assert none leaked) and :func:`remove` takes one out.

Example:
    >>> import phalanx.hooks as hooks
    >>> calls = []
    >>> hooks.install("doc.example", "module_forward_pre", lambda module, args: calls.append(module))
    True
    >>> "doc.example" in hooks.installed()
    True
    >>> _ = __import__("torch").nn.Identity()(1)
    >>> len(calls)
    1
    >>> hooks.remove("doc.example")
    True
    >>> "doc.example" in hooks.installed()
    False
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_forward_pre_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

# kind -> torch's public function that installs a global hook of that kind and returns a handle.
KINDS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "module_parameter_registration": register_module_parameter_registration_hook,
    "module_buffer_registration": register_module_buffer_registration_hook,
    "module_module_registration": register_module_module_registration_hook,
    "module_forward_pre": register_module_forward_pre_hook,
    "optimizer_step_pre": register_optimizer_step_pre_hook,
}

_LOCK = threading.Lock()
_HANDLES: dict[str, tuple[str, Any]] = {}  # name -> (kind, torch's RemovableHandle)


def install(name: str, kind: str, fn: Callable[..., Any]) -> bool:
    """Installs ``fn`` as a global torch hook of ``kind`` under ``name``, unless ``name`` is installed.

    Args:
        name: a unique name (by convention the installing module's, e.g. ``phalanx.core.capture.parameter``).
        kind: one of :data:`KINDS`.
        fn: the hook, with the signature torch's registration function expects.

    Returns:
        True if it was installed now, False if ``name`` already was.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`.
    """
    register = KINDS.get(kind)
    if register is None:
        raise ValueError(f"unknown global hook kind {kind!r}; expected one of {sorted(KINDS)}")
    with _LOCK:
        if name in _HANDLES:
            return False
        _HANDLES[name] = (kind, register(fn))
        return True


def installed() -> dict[str, str]:
    """The hooks phalanx has installed in this process: name -> kind."""
    with _LOCK:
        return {name: kind for name, (kind, _) in _HANDLES.items()}


def remove(name: str) -> bool:
    """Removes the hook installed as ``name``; False if there is none. It is installed again when needed."""
    with _LOCK:
        entry = _HANDLES.pop(name, None)
    if entry is None:
        return False
    entry[1].remove()
    return True
