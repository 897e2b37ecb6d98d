"""The package's shape, checked: no import cycle, no reaching into other classes' privates.

Both checks read the source with :mod:`ast` (nothing is imported), so they run in milliseconds
and fail with the offending edge or line. Run them alone with::

    pytest -q tests/test_architecture.py

The import graph counts every ``import`` of a ``phalanx`` module: top-level ones and the ones
inside functions (they run too, later), and, for the layer check and a second cycle check, those
under ``if TYPE_CHECKING:`` (a type checker follows them). Each module sits in one layer of
docs/ARCHITECTURE.md (``LAYERS``) and imports only its own layer or lower ones. An edge goes to the module named; a package's ``__init__`` is not counted as imported by
its submodules' imports (Python runs it first, but it is not a dependency of the importer).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx  # noqa: F401 - imported at collection: its first import sets torch's cache variables

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "phalanx"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST, *, type_only: bool = False):
    """Every node except those under ``if TYPE_CHECKING:`` (with ``type_only``, those too)."""
    if type_only:
        yield from ast.walk(tree)
        return
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(name: str, path: Path, modules: dict[str, Path], *, type_only: bool = False) -> set[str]:
    """The phalanx modules ``name`` imports at run time (``importlib.import_module`` of a literal too);
    with ``type_only``, also those it imports for type checkers only."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()

    def add(target: str) -> None:
        # The longest prefix that is a module of ours (``phalanx.x.y.Name`` -> ``phalanx.x.y``).
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in _runtime_nodes(tree, type_only=type_only):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("phalanx"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if not mod.startswith("phalanx"):
                continue
            for alias in node.names:
                full = f"{mod}.{alias.name}"
                add(full if full in modules else mod)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("phalanx")
        ):
            add(node.args[0].value)
    return out


def import_graph(*, type_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, type_only=type_only) for name, path in modules.items()}


# The layers of docs/ARCHITECTURE.md, bottom up: a module imports its own layer or lower ones.
LAYERS: dict[int, tuple[str, ...]] = {
    0: (
        "errors",
        "nest",
        "values",
        "devices",
        "config",
        "_sidetable",
        "_compat",
        "_lazy",
        "_signal_routing",
        "_tracebacks",
    ),
    1: ("cluster", "launch", "comm", "hooks", "interactive"),
    2: ("core", "input"),
    3: ("checkpoint", "summary", "trackers", "report", "profiler", "progress_bar"),
    4: ("strategies", "ps"),
    5: ("keras", "ray_train"),
    6: ("phalanx", "experimental", "nn", "coordinator", "cluster_resolver", "cli", "demo", "server"),
}


def layer_of(module: str) -> int | None:
    """The layer of ``phalanx.x.y`` (that of ``x``; the package's ``__init__`` is the façade, layer 6)."""
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "phalanx"
    return next((layer for layer, names in LAYERS.items() if key in names), None)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge from a module to a module of a higher layer, as ``"a -> b (La -> Lb)"``."""
    out = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb > la:
                out.append(f"{a} -> {b} (L{la} -> L{lb})")
    return out


def test_the_layer_check_can_fail():
    planted = {"phalanx.errors": {"phalanx.core.strategy"}, "phalanx.core.strategy": {"phalanx.errors"}}
    assert upward_imports(planted) == ["phalanx.errors -> phalanx.core.strategy (L0 -> L2)"]
    assert layer_of("phalanx.newthing") is None and layer_of("phalanx") == 6


def test_every_module_sits_in_a_layer():
    graph = import_graph()
    loose = sorted(m for m in graph if layer_of(m) is None)
    assert not loose, f"modules in no layer (add them to LAYERS and docs/ARCHITECTURE.md): {loose}"


def test_imports_point_down():
    """Type-only imports included: a type checker must not need a higher layer either."""
    upward = upward_imports(import_graph(type_only=True))
    assert not upward, "imports that point up a layer:\n  " + "\n  ".join(upward)


def folder_of(module: str) -> str:
    """The folder (or root module) ``phalanx.x.y`` lives in: ``x``; the package's ``__init__`` is ``phalanx``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "phalanx"


def folds(graph: dict[str, set[str]]) -> list[str]:
    """Every pair of folders of one layer that import each other, as ``"a <-> b (Ln): a.m -> b.n, b.o -> a.p"``.

    The layer rule lets a folder import its own layer; two folders that both do so fold the import
    graph back up, and which one sits below is no longer true of the code.
    """
    edges: dict[tuple[str, str], list[str]] = {}
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            fa, fb = folder_of(a), folder_of(b)
            if fa != fb and layer_of(a) is not None and layer_of(a) == layer_of(b):
                edges.setdefault((fa, fb), []).append(f"{a} -> {b}")
    return [
        f"{fa} <-> {fb} (L{layer_of('phalanx.' + fa)}): {edges[fa, fb][0]}, {edges[fb, fa][0]}"
        for fa, fb in sorted(edges)
        if fa < fb and (fb, fa) in edges
    ]


def test_the_fold_check_can_fail():
    planted = {
        "phalanx.core.strategy": {"phalanx.input.distributed_dataset"},
        "phalanx.input.distributed_dataset": {"phalanx.core.global_batch"},
        "phalanx.launch.launcher": {"phalanx.comm.communicator"},  # one way only: no fold
    }
    assert folds(planted) == [
        "core <-> input (L2): phalanx.core.strategy -> phalanx.input.distributed_dataset, "
        "phalanx.input.distributed_dataset -> phalanx.core.global_batch"
    ]


def test_no_two_folders_of_one_layer_import_each_other():
    """Type-only imports included, as for the layers."""
    found = folds(import_graph(type_only=True))
    assert not found, "folders of one layer that import each other (one of them belongs lower):\n  " + "\n  ".join(
        found
    )


# File names more than one module may carry: the same concept in parallel wings, never two concepts
# under one name (a reader who sees ``placement.py`` must know which placement). A new entry needs
# that argument here.
SHARED_FILE_NAMES = {
    "__init__.py": "every package's façade or docstring",
    "errors.py": "each package's typed errors (phalanx.errors, phalanx.ps.errors, phalanx.checkpoint.errors), in "
    "the style of the first",
    "keras.py": "each package's Keras part: _compat/keras.py (Keras' private APIs, beside _compat/torch.py and "
    "_compat/python.py) and ray_train/keras.py (Ray Train's Keras callback, public: "
    "phalanx.ray_train.keras.ReportCheckpointCallback in docs/clusters.md)",
}


def shared_file_names(paths: list[Path], allowed: dict[str, str]) -> list[str]:
    """Every file name that more than one of ``paths`` carries and ``allowed`` does not list, as
    ``"name: a/name, b/name"`` (paths relative to the package)."""
    by_name: dict[str, list[str]] = {}
    for p in paths:
        by_name.setdefault(p.name, []).append(p.relative_to(PACKAGE).as_posix())
    return [
        f"{name}: {', '.join(sorted(found))}"
        for name, found in sorted(by_name.items())
        if len(found) > 1 and name not in allowed
    ]


def test_the_shared_file_name_check_can_fail():
    planted = [PACKAGE / "cluster" / "placement.py", PACKAGE / "comm" / "placement.py", PACKAGE / "ps" / "errors.py"]
    planted.append(PACKAGE / "errors.py")
    assert shared_file_names(planted, SHARED_FILE_NAMES) == ["placement.py: cluster/placement.py, comm/placement.py"]
    assert shared_file_names(planted, {}) == [
        "errors.py: errors.py, ps/errors.py",
        "placement.py: cluster/placement.py, comm/placement.py",
    ]


MAX_CLASS_LINES = 400
LARGE_CLASSES = {"phalanx.core.extended.StrategyExtended"}  # TF's public contract (StrategyExtendedV2 is larger)


def large_classes(modules: dict[str, Path], allowed: set[str]) -> list[str]:
    """Every class of ``modules`` over :data:`MAX_CLASS_LINES` lines not in ``allowed``, as ``"module.Class (n)"``."""
    out = []
    for name, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES and f"{name}.{node.name}" not in allowed:
                    out.append(f"{name}.{node.name} ({lines})")
    return out


def test_the_class_size_check_can_fail(tmp_path):
    planted = tmp_path / "big.py"
    planted.write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES + "class Small:\n    pass\n")
    assert large_classes({"phalanx.big": planted}, set()) == [f"phalanx.big.Big ({MAX_CLASS_LINES + 1})"]
    assert large_classes({"phalanx.big": planted}, {"phalanx.big.Big"}) == []


def test_no_class_is_over_400_lines_but_the_extended():
    """A class that grows past this splits by concern into collaborators it holds (docs/ARCHITECTURE.md)."""
    found = large_classes(_modules(), LARGE_CLASSES)
    assert not found, "classes over 400 lines (split them into collaborators they hold):\n  " + "\n  ".join(found)


def test_no_two_modules_share_a_file_name_unless_allowed():
    found = shared_file_names(sorted(PACKAGE.rglob("*.py")), SHARED_FILE_NAMES)
    assert not found, (
        "modules of different concepts under one file name (rename one, or argue the shared concept in "
        "SHARED_FILE_NAMES):\n  " + "\n  ".join(found)
    )


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    parent: dict[str, str] = {}

    for root in sorted(graph):
        if color[root] != WHITE:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        color[root] = GREY
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = BLACK
                stack.pop()
                continue
            if color.get(nxt, BLACK) == GREY:
                cycle = [nxt]
                cur = node
                while cur != nxt:
                    cycle.append(cur)
                    cur = parent[cur]
                cycle.append(nxt)
                return cycle[::-1]
            if color.get(nxt) == WHITE:
                parent[nxt] = node
                color[nxt] = GREY
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def test_cycle_finder_finds_a_cycle():
    # The test must be able to fail: a graph with a cycle is reported, one without is not.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_parses_function_local_and_type_checking_imports(tmp_path):
    code = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from phalanx import b\n"
        "def f():\n    from phalanx import c\n    import importlib; importlib.import_module('phalanx.d')\n"
    )
    path = tmp_path / "a.py"
    path.write_text(code)
    modules = {m: path for m in ("phalanx.a", "phalanx.b", "phalanx.c", "phalanx.d")}
    assert _imports("phalanx.a", path, modules) == {"phalanx.c", "phalanx.d"}


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50, sorted(graph)  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_even_for_type_checkers(tmp_path):
    # The check can fail: a cycle closed by a type-only import is found.
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from phalanx import b\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from phalanx import a\n")
    modules = {"phalanx.a": a, "phalanx.b": b}
    planted = {m: _imports(m, p, modules, type_only=True) for m, p in modules.items()}
    assert find_cycle(planted) == ["phalanx.a", "phalanx.b", "phalanx.a"]
    cycle = find_cycle(import_graph(type_only=True))
    assert cycle is None, "import cycle (type-only imports included): " + " -> ".join(cycle)


# ------------------------------------------------------------------------------------ the core and Keras
def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_torch_program_never_loads_keras_or_its_integration():
    _run(
        "import sys, torch, phalanx as px\n"
        "with px.OneDeviceStrategy('cpu').scope():\n    model = torch.nn.Linear(2, 1)\n"
        "assert 'keras' not in sys.modules and 'phalanx.keras' not in sys.modules, 'scope() loaded Keras'\n"
    )


@pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="Keras is not installed")
@pytest.mark.parametrize("order", ["keras first", "phalanx first", "keras inside the scope"])
def test_a_keras_model_built_in_scope_is_distributed_without_an_extra_import(order):
    # tf.keras is strategy-aware by itself: a TF program ported by the rename imports no phalanx.keras.
    # Without the integration, fit would run undistributed on every replica: wrong, silently.
    imports = {
        "keras first": ("import keras, phalanx as px\n", ""),
        "phalanx first": ("import phalanx as px, keras\n", ""),
        "keras inside the scope": ("import phalanx as px\n", "        import keras\n"),
    }[order]
    _run(
        "import os, sys\nos.environ.setdefault('KERAS_BACKEND', 'torch')\n"
        + imports[0]
        + "strategy = px.OneDeviceStrategy('cpu')\n"
        "if True:\n    with strategy.scope():\n"
        + imports[1]
        + "        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])\n"
        "import phalanx.keras\n"
        "assert phalanx.keras.distributed_model(model) is not None, 'the model is not distributed'\n"
        "assert phalanx.keras.distributed_model(model).strategy is strategy\n"
    )


def test_modules_imported_by_a_computed_name_are_the_documented_ones():
    # importlib.import_module of a non-literal escapes the import graph above; it is allowed only
    # where the name comes from a table that is itself the documented rule: the lazy facades, the
    # integrations joined when their library is loaded (an upward import by design, as entry points
    # are), the fork server's preloads (third-party modules named on the command line), and a PS
    # worker loading the integration that registered a reference kind (named in a signed message).
    allowed = {"phalanx._lazy", "phalanx.core.integrations", "phalanx.launch.forkserver_process", "phalanx.ps.pickling"}
    found = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and not (node.args and isinstance(node.args[0], ast.Constant))
            ):
                found.add(name)
    assert found <= allowed, f"modules imported by a computed name outside the documented places: {found - allowed}"
    from phalanx.core import integrations

    for integration in integrations.INTEGRATIONS.values():
        assert importlib.util.find_spec(integration) is not None, integration


def test_scope_works_next_to_a_keras_that_phalanx_keras_refuses():
    # A torch-only program in a process where some other code imported a Keras phalanx.keras would
    # refuse (here: a fake 'keras' 2.x module) must still be able to use a strategy.
    _run(
        "import sys, types, torch\nfake = types.ModuleType('keras'); fake.__version__ = '2.15.0'\n"
        "sys.modules['keras'] = fake\nimport phalanx as px\n"
        "strategy = px.OneDeviceStrategy('cpu')\n"
        "with strategy.scope():\n    model = torch.nn.Linear(2, 1)\n"
        "out = strategy.run(lambda: model(torch.ones(1, 2)).sum())\n"
        "assert 'phalanx.keras' not in sys.modules\n"
    )


def test_scope_works_next_to_a_keras_3_on_torch_of_a_version_phalanx_keras_refuses():
    # Keras 3 on torch, but older than phalanx.keras supports: the integration's import refuses it
    # (UnsupportedKerasError); scope() leaves it out, and a torch-only program goes on.
    _run(
        "import sys, types, torch\nfake = types.ModuleType('keras'); fake.__version__ = '3.2.0'\n"
        "fake.backend = types.SimpleNamespace(backend=lambda: 'torch')\n"
        "sys.modules['keras'] = fake\nimport phalanx as px\n"
        "strategy = px.OneDeviceStrategy('cpu')\n"
        "for _ in range(2):\n    with strategy.scope():\n        model = torch.nn.Linear(2, 1)\n"
        "out = strategy.run(lambda: model(torch.ones(1, 2)).sum())\n"
        "assert 'phalanx.keras' not in sys.modules\n"
        "from phalanx.core import integrations\nassert integrations._REFUSED == {'phalanx.keras'}\n"
    )


# ------------------------------------------------------------------------------------ private members
# Accesses to another object's ``_`` members that are allowed, each with the reason. Everything
# else must go through the public contract (``StrategyExtended``'s documented surface, public
# worker operations, ...). A line may also mark itself ``# friend: <reason>``, as TF marks its
# friend accesses ``# pylint: disable=protected-access``.
ALLOWED_PREFIX = "phalanx._compat"  # the one boundary to foreign private APIs: see its docstring
_UNUSED = {
    # The one boundary to foreign private APIs (torch, Keras, CPython): see its module docstring.
    "phalanx._compat.torch",
    "phalanx._compat.keras",
}
# (module, member): foreign private APIs still used outside _compat, each with its owner's plan.
PENDING: set[tuple[str, str]] = set()
ALLOWED_NAMES = {
    "_replace",
    "_asdict",
    "_fields",
    "_make",  # namedtuple's public API has underscores
    "_exit",  # os._exit: the documented way to end a forked/orphaned process without teardown
    "_getframe",
}


def _defined_names(tree: ast.AST) -> set[str]:
    """The ``_`` names a module defines: functions, classes, ``self._x =`` assignments, class attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            # Only what a class sets on itself: ``shell._showtraceback = ...`` on a foreign object
            # (IPython's) defines nothing of ours, so reading it elsewhere is a foreign private read.
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.AnnAssign,)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.rpartition(".")[2])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and ast.unparse(node.func) in ("setattr", "object.__setattr__")
        ):
            names.add(str(node.args[1].value))  # object.__setattr__(self, "_x", ...) in a frozen class
    slots = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets)
    ]
    for node in slots:
        for const in ast.walk(node.value):
            if isinstance(const, ast.Constant) and isinstance(const.value, str):
                names.add(const.value)
    return names


def _package_names(path: Path) -> set[str]:
    """The ``_`` names defined anywhere in ``path``'s subpackage (``phalanx.ps``, ...): package-private.

    Modules of one subpackage are one unit (as Java's package-private): the coordinator and its
    closures, a checkpoint and its preemption handler. The top-level package is not one unit.
    """
    if path.parent == PACKAGE:
        return set()
    return set().union(*(_defined_names(ast.parse(p.read_text())) for p in path.parent.glob("*.py")))


# A private module of a library phalanx depends on, named in a string.
_FOREIGN_PATH = __import__("re").compile(
    r"^(torch|keras|IPython|ipykernel|jupyter_client|threading|multiprocessing|numpy|grpc)(\.\w+)*\._[A-Za-z]"
)


def _is_attr_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def private_reaches(path: Path, module: str = "") -> list[str]:
    """``file:line: expr`` for each read of another object's ``_`` member the rules do not allow."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, str(path))
    own = _defined_names(tree) | _package_names(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _FOREIGN_PATH.match(node.value):
            # A private module of a library named by a string (a logger's name, importlib):
            # the same reach into private API as an attribute, where only _compat may make it.
            if "# friend" not in lines[node.lineno - 1]:
                found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {node.value!r}")
            continue
        if _is_attr_call(node):
            # getattr(x, "_name", ...), hasattr, setattr, delattr: a member named by a string.
            receiver, attr = node.args[0], node.args[1].value
            node = ast.Attribute(value=receiver, attr=attr, ctx=ast.Load(), lineno=node.lineno)
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or (attr.startswith("__") and attr.endswith("__")):
            continue
        receiver = node.value
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            continue
        if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super":
            continue
        if attr in own or attr in ALLOWED_NAMES or (module, attr) in PENDING:
            continue  # a member of a class of this module (module-private, as Python means it)
        if attr.startswith("_phalanx_") and attr.endswith("_"):
            continue  # phalanx's own duck-typed protocols (checkpoint.sharding's _phalanx_full_tensor_)
        line = lines[node.lineno - 1]
        if "# friend" in line:
            continue
        found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_member_check_can_fail(tmp_path):
    path = SRC / "phalanx" / "_probe_for_test.py"
    try:
        path.write_text(
            "class A:\n    def __init__(self):\n        self._mine = 1\n"
            "def f(a, b):\n    y = b._x  # friend: allowed\n    return a._mine, b.extended._comm\n"
        )
        assert private_reaches(path) == ["src/phalanx/_probe_for_test.py:6: b.extended._comm"]
        # Named by a string, or set on a foreign object (which defines nothing of ours).
        path.write_text(
            "import logging, threading\n"
            "register = getattr(threading, '_register_atexit', None)\n"
            "log = logging.getLogger('torch._dynamo.convert_frame')\n"
            "def g(shell):\n    shell._showtraceback = print\n    shell._showtraceback(1)\n"
            "def h(obj):\n    obj._phalanx_tag_ = 1\n    return getattr(obj, '_phalanx_tag_')\n"
        )
        assert private_reaches(path) == [
            "src/phalanx/_probe_for_test.py:2: threading._register_atexit",
            "src/phalanx/_probe_for_test.py:3: 'torch._dynamo.convert_frame'",
            "src/phalanx/_probe_for_test.py:5: shell._showtraceback",
            "src/phalanx/_probe_for_test.py:6: shell._showtraceback",
        ], private_reaches(path)
    finally:
        path.unlink()


def test_no_module_reads_another_class_private_members():
    found = []
    for name, path in _modules().items():
        if not name.startswith(ALLOWED_PREFIX):
            found += private_reaches(path, name)
    assert not found, (
        "private members read from outside their module (use the public contract, or mark "
        "a friend access `# friend: <why>`):\n" + "\n".join(found)
    )


TESTS_PRIVATE = __import__("re").compile(r"extended\._[a-z]|\._comm\b")


def test_tests_and_benchmarks_use_the_public_contract():
    root = SRC.parent
    found = [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for folder in ("tests", "benchmarks")
        for p in sorted((root / folder).rglob("*.py"))
        if p.name != "test_architecture.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if TESTS_PRIVATE.search(line)
    ]
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------------------ processes
# Starting a process from a command, reaping one, or signalling one by its pid belongs to the one
# Supervisor (launch/): a notebook's replicas too (issue 30). What stays elsewhere is the fork of a
# notebook kernel (a replica that goes on from the kernel's own state; the Supervisor adopts it)
# and a process signalling itself.
PROCESS_CALLS = __import__("re").compile(
    r"subprocess\.(Popen|run|call|check_call|check_output)\(|os\.(waitpid|wait|kill|killpg)\("
)


# Commands a user would type, run to their end by tools (not replicas): `phalanx bench` runs the
# benchmarks, the demo runs `phalanx run` as its reader would.
TOOL_COMMANDS = {"phalanx.cli", "phalanx.demo"}
LIVENESS_PROBE = __import__("re").compile(r"os\.kill\([^,()]+,\s*0\)")


def process_calls(path: Path) -> list[str]:
    """``file:line: code`` for each call that starts, reaps or signals a process outside launch/
    (signal 0, a liveness probe that sends nothing, and a process signalling itself excepted)."""
    found = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if PROCESS_CALLS.search(line) and "os.kill(os.getpid()" not in line and not LIVENESS_PROBE.search(line):
            found.append(f"{path.relative_to(SRC.parent)}:{i}: {line.strip()}")
    return found


def test_the_process_check_can_fail(tmp_path):
    probe = SRC / "phalanx" / "_probe_for_test.py"
    try:
        probe.write_text(
            "import os, subprocess\nsubprocess.Popen(['x'])\nos.kill(os.getpid(), 2)\nos.waitpid(1, 0)\n"
            "os.kill(pid, 0)\nos.kill(pid, 9)\n"
        )
        assert [f.split(": ", 1)[0] for f in process_calls(probe)] == [
            "src/phalanx/_probe_for_test.py:2",
            "src/phalanx/_probe_for_test.py:4",
            "src/phalanx/_probe_for_test.py:6",
        ]
    finally:
        probe.unlink()


def test_only_the_supervisor_starts_reaps_or_signals_processes():
    found = [
        f
        for name, path in _modules().items()
        if not name.startswith("phalanx.launch") and name not in TOOL_COMMANDS
        for f in process_calls(path)
    ]
    assert not found, "start, reap and signal processes through launch.supervisor.Supervisor:\n" + "\n".join(found)


# ------------------------------------------------------------------------------------ settings
def test_every_phalanx_variable_is_a_setting_or_the_launchers_identity():
    # One place says what the process can be configured with: phalanx.config.Settings (plus the
    # PHALANX_RANK... family through which a launcher tells a replica who it is, and the two
    # variables the supervisor sets for its children, named in launch/env.py).
    import dataclasses
    import re

    from phalanx.config import Settings
    from phalanx.launch.env import PREFIX, SUPERVISOR_VARIABLES, ReplicaEnv

    known = (
        set(Settings.variables())
        | {PREFIX + f.name.upper() for f in dataclasses.fields(ReplicaEnv)}
        | set(SUPERVISOR_VARIABLES)
    )
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in re.findall(r"\bPHALANX_[A-Z][A-Z0-9_]*\b", path.read_text()):
            if not name.endswith("_"):  # a prefix (PHALANX_TLS_...), not a variable
                found.setdefault(name, path.relative_to(SRC.parent))
    unknown = {name: str(where) for name, where in found.items() if name not in known}
    assert not unknown, f"PHALANX_* variables missing from phalanx.config.Settings: {unknown}"
