"""The lazy facades (phalanx._lazy): processes that never touch a tensor do not import torch, and
every public name still resolves to the object its module defines."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
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
import phalanx, phalanx.launch.runner, phalanx.launch.self_launch, phalanx.launch.supervisor, phalanx.ps.launcher
from phalanx.cli import _oversubscription_warning, build_parser
build_parser().parse_args(["run", "-n", "2", "train.py"])
_oversubscription_warning(64)
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:5]
print("no torch")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "no torch" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("package", sorted(FACADES))
def test_facade_tables_match_their_type_checking_imports(package):
    """What type checkers see (the imports under TYPE_CHECKING) is what the lazy table serves."""
    tree = ast.parse(FACADES[package].read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {}
    for node in guarded.body:
        for alias in node.names:
            seen[alias.name] = f"{package}.{alias.name}" if node.module == package else node.module
    module = importlib.import_module(package)
    table = {name: f"{package}.{name}" for name in getattr(module, "_SUBMODULES", ())}
    table.update(module._ATTRIBUTES)
    assert seen == table
    for name, where in table.items():
        value = getattr(module, name)
        expected = (
            importlib.import_module(where)
            if where == f"{package}.{name}"
            else getattr(importlib.import_module(where), name)
        )
        assert value is expected, name
    assert set(table) <= set(module.__all__) and set(module.__all__) <= set(dir(module))


def test_unknown_name_is_an_attribute_error_naming_it():
    import phalanx

    with pytest.raises(AttributeError, match="'MirrorStrategy'"):
        phalanx.MirrorStrategy  # noqa: B018 - the lookup is the test
    assert not hasattr(phalanx, "nope")
