"""Lazy package facades (PEP 562): a public name is imported on its first use.

The same contract as scientific-python's ``lazy_loader.attach``: a package lists its public names
and the modules defining them, and gets the module-level ``__getattr__``, ``__dir__`` and
``__all__`` to assign. ``import phalanx`` then costs almost nothing, so the processes that never
touch a tensor (``phalanx run``'s supervisor, the parameter-server cluster launcher,
``phalanx --help``) do not import torch: 1.3-1.8 s of CPU and ~300 MB each.

Example:
    >>> __getattr__, __dir__, __all__ = attach("phalanx", {"nn"}, {"ReduceOp": "phalanx.values"})
    >>> __getattr__("ReduceOp").SUM.value
    'SUM'
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any


def attach(
    package: str, submodules: Collection[str], attributes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The lazy ``__getattr__``, ``__dir__`` and ``__all__`` of ``package``.

    Args:
        package: the package's ``__name__``.
        submodules: its submodules that are public names (``phalanx.nn``).
        attributes: public name -> the module that defines it.
    """
    subs = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name in subs:
            return importlib.import_module(f"{package}.{name}")
        module = attributes.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | subs | set(attributes))

    return __getattr__, __dir__, sorted(subs | set(attributes))
