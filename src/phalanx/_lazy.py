"""Lazy package facades (PEP 562): a public name is imported on its first use.

The same contract as scientific-python's ``lazy_loader.attach``: a package lists its public names
and the modules defining them, and gets the module-level ``__getattr__``, ``__dir__`` and
``__all__`` to assign. ``import phalanx`` then costs almost nothing, so the processes that never
touch a tensor (``phalanx run``'s supervisor, the parameter-server cluster launcher,
``phalanx --help``) do not import torch: 1.3-1.8 s of CPU and ~300 MB each. A public module path
that names a module living elsewhere is an alias (:func:`alias_modules`).

Example:
    >>> __getattr__, __dir__, __all__ = attach("phalanx", {"nn"}, {"ReduceOp": "phalanx.values"})
    >>> __getattr__("ReduceOp").SUM.value
    'SUM'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Collection, Mapping
from types import ModuleType
from typing import Any


def attach(
    package: str, submodules: Collection[str] | Mapping[str, str], attributes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The lazy ``__getattr__``, ``__dir__`` and ``__all__`` of ``package``.

    Args:
        package: the package's ``__name__``.
        submodules: the modules that are public names: names of its submodules (``phalanx.nn``),
            or public name -> the module it is (``"compiled": "phalanx.core.compiled"``).
        attributes: public name -> the module that defines it.
    """
    modules = dict(submodules) if isinstance(submodules, Mapping) else {s: f"{package}.{s}" for s in submodules}
    subs = frozenset(modules)

    def __getattr__(name: str) -> Any:
        if name in subs:
            module = importlib.import_module(modules[name])
            setattr(sys.modules[package], name, module)
            return module
        module = attributes.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | subs | set(attributes))

    return __getattr__, __dir__, sorted(subs | set(attributes))


class _ModuleAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of an alias give the module it names (see :func:`alias_modules`)."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self._specs: dict[str, Any] = {}  # alias -> the spec of the module it gives

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in self.aliases else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.aliases[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias's spec on the module (it always sets __spec__):
        # give the module back its own.
        module.__spec__ = self._specs.pop(module.__spec__.name)


def alias_modules(aliases: Mapping[str, str]) -> None:
    """Makes ``import alias`` give the module ``target`` for each ``alias -> target`` of ``aliases``.

    The alias becomes another name of the same module object (``sys.modules`` holds both), so
    code, pickles and patches that name either path see one module. phalanx uses it for one public
    path, ``phalanx.compiled`` (the module lives in :mod:`phalanx.core.compiled`). Calling it again
    adds names.

    Example:
        >>> alias_modules({"phalanx.other_values": "phalanx.values"})
        >>> import phalanx.other_values
        >>> phalanx.other_values is sys.modules["phalanx.values"]
        True
    """
    finder = next((f for f in sys.meta_path if isinstance(f, _ModuleAliases)), None)
    if finder is None:
        finder = _ModuleAliases()
        sys.meta_path.append(finder)
    finder.aliases.update(aliases)
