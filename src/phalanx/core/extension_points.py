"""The core's extension points: how integrations above the core join a strategy's scope and steps.

The core calls them; an upper layer joins them when it is imported (``phalanx.keras`` does), so
the core never imports, or validates, the library it serves (docs/ARCHITECTURE.md, "Extension
points"):

* :data:`RUN_OBSERVERS` / :data:`RUN_ARGUMENT_OBSERVERS`: called before each ``strategy.run``
  with the step function / with its arguments;
* :func:`register_scope_enter_hook`: called at every ``strategy.scope()`` entry;
* :func:`register_device_context`: a context entered around ``scope()`` and every ``run``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

# Called as ``observe(strategy, fn)`` before each ``run``; phalanx.keras adds one for metrics.
RUN_OBSERVERS: list[Callable[[Any, Callable[..., Any]], None]] = []
# Called as ``observe(strategy, args, kwargs)`` before each ``run`` with what ``fn`` is given
# (phalanx.keras adapts a Keras optimizer passed to the step function, as it does one ``fn`` names).
RUN_ARGUMENT_OBSERVERS: list[Callable[[Any, tuple, dict], None]] = []


ScopeEnterHook = Callable[[Any], None]
_SCOPE_ENTER_HOOKS: list[ScopeEnterHook] = []
_SCOPE_HOOKS_LOCK = threading.Lock()


def register_scope_enter_hook(hook: ScopeEnterHook) -> None:
    """Calls ``hook(strategy)`` whenever a (non-default) strategy's ``scope()`` is entered.

    The extension point for integrations above the core: ``phalanx.keras`` joins it when it is
    imported, so the core itself never imports, or validates, Keras. Registering a hook twice
    has no effect.
    """
    with _SCOPE_HOOKS_LOCK:
        if hook not in _SCOPE_ENTER_HOOKS:
            _SCOPE_ENTER_HOOKS.append(hook)


DeviceContext = Callable[[Any], "contextlib.AbstractContextManager[Any] | None"]
_DEVICE_CONTEXTS: list[DeviceContext] = []


def register_device_context(factory: DeviceContext) -> None:
    """Enters ``factory(strategy)`` (unless it returns None) around ``scope()`` and every ``run``.

    For a framework that places tensors on a default device of its own, so that what it makes
    inside the strategy lands on the replica's device, as TF places a replica's ops: Keras on the
    torch backend uses the GPU whenever one exists, also for CPU replicas. ``phalanx.keras``
    registers one; the factory should return None fast where nothing needs changing (it is
    called at every step). Registering a factory twice has no effect.
    """
    with _SCOPE_HOOKS_LOCK:
        if factory not in _DEVICE_CONTEXTS:
            _DEVICE_CONTEXTS.append(factory)


@contextlib.contextmanager
def _device_contexts(strategy: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for factory in _DEVICE_CONTEXTS:
            cm = factory(strategy)
            if cm is not None:
                stack.enter_context(cm)
        yield
