"""Integrations that join as soon as the library they integrate is in the process.

A TensorFlow program never imports anything extra for ``tf.keras`` to be strategy-aware. phalanx's
Keras integration (:mod:`phalanx.keras`) lives above the core, which never imports Keras: the
core asks, at each strategy scope entry (and when a parameter is created in scope from a library's
frame), whether a library with an integration is loaded, and imports its integration then, by
name, as entry points are loaded. So ``import keras`` and ``import phalanx``, in either order,
distribute Keras models built in ``scope()``; a program that never imports Keras never loads it.

Example:
    >>> from phalanx.core import integrations
    >>> integrations.INTEGRATIONS["keras"]
    'phalanx.keras'
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from phalanx.errors import PhalanxError

# library -> the phalanx package that integrates it (imported by name: it sits above the core).
INTEGRATIONS: dict[str, str] = {"keras": "phalanx.keras"}


def _keras_ready(keras: ModuleType) -> bool:
    """Keras 3 on the torch backend: the one phalanx.keras supports. Another Keras (2.x, or 3 on
    JAX) loaded by other code must not stop a torch-only program from using a strategy."""
    version = str(getattr(keras, "__version__", ""))
    backend = getattr(getattr(keras, "backend", None), "backend", None)
    return version.startswith("3.") and callable(backend) and backend() == "torch"


_READY = {"keras": _keras_ready}
_REFUSED: set[str] = set()  # integrations whose import refused the loaded library (its version)


def activate_loaded(*, force: bool = False) -> list[str]:
    """Imports the integration of every supported library already loaded; returns those imported now.

    Args:
        force: import the integration of a loaded library even if it looks unsupported, so that
            its own typed error (``UnsupportedKerasError``) names what is wrong: for a library
            whose objects are being built in a strategy's scope.
    """
    activated = []
    for library, integration in INTEGRATIONS.items():
        module = sys.modules.get(library)
        if module is None or integration in sys.modules:
            continue
        if not force and (integration in _REFUSED or not _READY[library](module)):
            continue
        try:
            importlib.import_module(integration)
        except PhalanxError:
            # A version the integration refuses (UnsupportedKerasError): a torch-only program beside
            # it keeps working; building that library's objects in a scope (force) raises the error.
            if force:
                raise
            _REFUSED.add(integration)
            continue
        activated.append(integration)
    return activated
