"""The lazy facades (phalanx._lazy): processes that never touch a tensor do not import torch, and
every public name still resolves to the object its module defines."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src" / "phalanx"
FACADES = {"phalanx": SRC / "__init__.py", "phalanx.ps": SRC / "ps" / "__init__.py"}


def test_launchers_do_not_import_torch():
    """`phalanx run`'s supervisor, the parameter-server launcher and `phalanx --help` imported torch
    (through the eager facade, and the wire for the secret's name):
    1.5 s of CPU and ~300 MB per launcher, for a process that only starts and watches others."""
    code = """
import sys
import phalanx, phalanx.launch.runner, phalanx.launch.self_launch, phalanx.launch.supervisor, phalanx.ps.cluster_launcher
from phalanx.cli import _oversubscription_warning, build_parser
build_parser().parse_args(["run", "-n", "2", "train.py"])
_oversubscription_warning(64)
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:5]
print("no torch")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "no torch" in res.stdout, res.stderr[-3000:]


def _submodule(module: str, name: str) -> str | None:
    """``module.name`` if that is a module, else None (``name`` is an attribute of ``module``)."""
    if isinstance(getattr(importlib.import_module(module), name, None), types.ModuleType):
        return f"{module}.{name}"
    try:
        importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return None
    return f"{module}.{name}"


@pytest.mark.parametrize("package", sorted(FACADES))
def test_facade_tables_match_their_type_checking_imports(package):
    """What type checkers see (the imports under TYPE_CHECKING) is what the lazy table serves."""
    tree = ast.parse(FACADES[package].read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {}  # name -> the module it is (a submodule), or the module that defines it
    for node in guarded.body:
        for alias in node.names:
            seen[alias.name] = _submodule(node.module, alias.name) or node.module
    module = importlib.import_module(package)
    submodules = getattr(module, "_SUBMODULES", {})
    if not isinstance(submodules, dict):
        submodules = {name: f"{package}.{name}" for name in submodules}
    table = {**submodules, **module._ATTRIBUTES}
    assert seen == table
    for name, where in table.items():
        value = getattr(module, name)
        expected = (
            importlib.import_module(where) if name in submodules else getattr(importlib.import_module(where), name)
        )
        assert value is expected, name
    assert set(table) <= set(module.__all__) and set(module.__all__) <= set(dir(module))


def test_unknown_name_is_an_attribute_error_naming_it():
    import phalanx

    with pytest.raises(AttributeError, match="'MirrorStrategy'"):
        phalanx.MirrorStrategy  # noqa: B018 - the lookup is the test
    assert not hasattr(phalanx, "nope")


def test_phalanx_compiled_is_the_core_module_and_the_old_core_paths_are_gone():
    """``phalanx.compiled`` is a public path (``px.compiled.CompileFallbackWarning``): the same module
    as phalanx.core.compiled, without a warning. The pre-0.1.0 root paths (``phalanx.strategy``) are gone."""
    code = """
import sys, warnings
with warnings.catch_warnings():
    warnings.simplefilter("error")
    from phalanx.compiled import CompileFallbackWarning
    import phalanx.compiled
assert CompileFallbackWarning is sys.modules["phalanx.core.compiled"].CompileFallbackWarning
assert phalanx.compiled is sys.modules["phalanx.core.compiled"]
assert phalanx.compiled.__spec__.name == "phalanx.core.compiled", phalanx.compiled.__spec__
for old in ("phalanx.strategy", "phalanx.distributed_variable", "phalanx.strategies.parameter_server"):
    try:
        __import__(old)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(old + " still imports")
print("moved ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "moved ok" in res.stdout, res.stderr[-3000:]
