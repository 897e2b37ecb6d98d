"""Lazy package facades (PEP 562): a public name is imported on its first use.

The same contract as scientific-python's ``lazy_loader.attach``: a package lists its public names
and the modules defining them, and gets the module-level ``__getattr__``, ``__dir__`` and
``__all__`` to assign. ``import phalanx`` then costs almost nothing, so the processes that never
touch a tensor (``phalanx run``'s supervisor, the parameter-server cluster launcher,
``phalanx --help``) do not import torch: 1.3-1.8 s of CPU and ~300 MB each. A module that moved
keeps its old import path (:func:`moved_modules`).

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
import warnings
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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of a module's old name give the module at its new one (see :func:`moved_modules`)."""

    def __init__(self) -> None:
        self.moved: dict[str, str] = {}
        self.quiet: set[str] = set()  # old names that are public names too: no warning
        self._specs: dict[str, Any] = {}  # old name -> the spec of the module it gives

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in self.moved else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self.moved[spec.name]
        if spec.name not in self.quiet:
            # stacklevel 2: the warning skips importlib's own frames and names the importing line.
            warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the old name's spec on the module (it always sets
        # __spec__): give the module back its own.
        module.__spec__ = self._specs.pop(module.__spec__.name)


def moved_modules(moved: Mapping[str, str], *, warn: bool = True) -> None:
    """Makes ``import old`` give the module ``new`` for each ``old -> new`` of ``moved``.

    The old name becomes another name of the same module object (``sys.modules`` holds both), so
    code, pickles and patches that name the old path keep working; each first import of an old
    name warns (``DeprecationWarning``) with the new one, unless ``warn`` is False (the old name
    is a public name that stays, ``phalanx.compiled``). Calling it again adds names.

    Example:
        >>> moved_modules({"phalanx.old_values": "phalanx.values"})
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     import phalanx.old_values
        >>> str(caught[0].message)
        'phalanx.old_values moved to phalanx.values; import it from there'
        >>> phalanx.old_values is sys.modules["phalanx.values"]
        True
    """
    finder = next((f for f in sys.meta_path if isinstance(f, _MovedModules)), None)
    if finder is None:
        finder = _MovedModules()
        sys.meta_path.append(finder)
    finder.moved.update(moved)
    finder.quiet.difference_update(moved)
    if not warn:
        finder.quiet.update(moved)
