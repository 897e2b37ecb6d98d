"""The case registry of the conformance suite: the ``case`` decorator, the context a case gets, helpers.

A case is a small function ``fn(strategy, ctx)`` that raises ``AssertionError`` when phalanx does
not behave as TensorFlow does. Every process of a job runs every case, in the same order (SPMD), so
the collectives a case makes meet on every replica.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

#: The strategy configurations of the suite (names of tests/strategies.py's matrix).
ONE_DEVICE = "one_device"
MIRRORED = "mirrored_cpu_2"
CENTRAL_STORAGE = "central_storage_cpu_2"
MULTI_WORKER = "multi_worker_2"
ALL = (ONE_DEVICE, MIRRORED, CENTRAL_STORAGE, MULTI_WORKER)
#: TF's ``multidevice_strategies``: more than one replica.
MULTI = (MIRRORED, CENTRAL_STORAGE, MULTI_WORKER)
#: One worker holding every replica (TF's single-host strategies).
SINGLE_WORKER = (ONE_DEVICE, MIRRORED, CENTRAL_STORAGE)
#: The suites: TF's tensorflow/python/distribute tests (``cases_*.py``) and tf_keras/distribute's
#: (``keras/cases_*.py``). Each suite runs in jobs of its own.
SUITES = ("tf", "keras")


@dataclass(frozen=True)
class Case:
    """One translated TF test.

    Attributes:
        id: ``<module>.<function>``, e.g. ``strategy_common.reduce_host_tensor``; a case of the Keras
            suite (``tf_conformance/keras/``) is ``keras.<module>.<function>``.
        fn: the case itself, ``fn(strategy, ctx)``.
        source: TF's file and test, e.g. ``strategy_common_test.py StrategyReduceTest.testReduceHostTensor``.
        strategies: the configurations it applies to (as TF's ``combinations`` say).
        suite: ``tf`` (tensorflow/python/distribute's tests) or ``keras`` (tf_keras/distribute's tests).
    """

    id: str
    fn: Callable[[Any, "Ctx"], None]
    source: str
    strategies: tuple[str, ...]
    suite: str = "tf"


CASES: list[Case] = []


def case(source: str, strategies: tuple[str, ...] = ALL) -> Callable[[Callable], Callable]:
    """Registers a case; ``source`` names TF's file and test it translates."""

    def register(fn: Callable) -> Callable:
        module = fn.__module__.rsplit(".", 1)[-1].removeprefix("cases_")
        suite = "keras" if ".keras." in fn.__module__ else "tf"
        case_id = f"keras.{module}.{fn.__name__}" if suite == "keras" else f"{module}.{fn.__name__}"
        if any(c.id == case_id for c in CASES):
            raise ValueError(f"case {case_id} is registered twice")
        unknown = set(strategies) - set(ALL)
        if unknown:
            raise ValueError(f"case {case_id}: unknown strategies {sorted(unknown)}")
        CASES.append(Case(case_id, fn, source, tuple(strategies), suite))
        return fn

    return register


@dataclass(frozen=True)
class Ctx:
    """What a case knows about the job it runs in.

    Attributes:
        name: the configuration (one of ``ALL``).
        rank: this process's replica id (its place in the synchronous group).
        n: replicas in sync.
        local_n: replicas of this worker (TF's ``experimental_local_results`` length): every replica
            for a single-host strategy, one per worker for MultiWorkerMirrored 2x1.
        worker: this worker's index (0 on single-host strategies).
        task_type: TF's task type of this worker in TF's 2x1 tests: ``chief`` for worker 0.
    """

    name: str
    rank: int
    n: int
    local_n: int
    worker: int

    @property
    def task_type(self) -> str:
        return "chief" if self.worker == 0 else "worker"

    @property
    def multi_worker(self) -> bool:
        return self.name == MULTI_WORKER


# ----------------------------------------------------------------------------- helpers
def to_list(value: Any) -> Any:
    """A tensor, number or nested structure of them as plain Python lists/numbers."""
    import torch

    if not isinstance(value, torch.Tensor) and hasattr(value, "read_value"):  # a variable
        value = value.read_value()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {k: to_list(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_list(v) for v in value]
    return value


def assert_equal(got: Any, expected: Any, what: str = "") -> None:
    """``got`` (tensors allowed, nested) equals ``expected`` (plain values)."""
    g = to_list(got)
    e = to_list(expected)
    assert g == e, f"{what + ': ' if what else ''}expected {e!r}, got {g!r}"


def assert_close(got: Any, expected: Any, what: str = "", tol: float = 1e-5) -> None:
    """As :func:`assert_equal`, numbers compared within ``tol``."""
    g, e = to_list(got), to_list(expected)

    def close(a: Any, b: Any) -> bool:
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return abs(a - b) <= tol * max(1.0, abs(b))
        return a == b

    assert close(g, e), f"{what + ': ' if what else ''}expected {e!r}, got {g!r}"


@contextlib.contextmanager
def raises(*types: type[BaseException], match: str | None = None) -> Iterator[None]:
    """Asserts the block raises one of ``types`` (TF's error class), optionally matching ``match``."""
    import re

    try:
        yield
    except types as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(
                f"raised {type(e).__name__} as expected, but {str(e)[:300]!r} does not match {match!r}"
            ) from e
        return
    except Exception as e:  # noqa: BLE001 - the wrong type is the finding
        names = "/".join(t.__name__ for t in types)
        raise AssertionError(f"expected {names}, got {type(e).__name__}: {str(e)[:300]}") from e
    names = "/".join(t.__name__ for t in types)
    raise AssertionError(f"expected {names}, nothing was raised")


def local(strategy: Any, value: Any) -> list[Any]:
    """``strategy.experimental_local_results(value)`` as a list of plain values."""
    return [to_list(v) for v in strategy.experimental_local_results(value)]


def flat_local(strategy: Any, value: Any) -> list[Any]:
    """TF's ``assert_equal_flattened``: this worker's replica results, concatenated."""
    out: list[Any] = []
    for v in strategy.experimental_local_results(value):
        v = to_list(v)
        out.extend(v if isinstance(v, list) else [v])
    return out
