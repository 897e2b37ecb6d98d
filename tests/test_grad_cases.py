"""Sparse gradients, lazy modules and a layer thawed inside a step train as on one device (issue 50).

Each failed under MirroredStrategy before: ``RuntimeError: Cannot access data pointer of Tensor that
doesn't have storage`` (sparse), ``ValueError: Attempted to use an uninitialized parameter``
(lazy), ``ReplicaDivergenceError`` two steps after the thaw. The script is
``tests/scripts/grad_cases.py``; plain torch on one device is the reference.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import strategies
from conftest import jobs_on_first_use

SCRIPT = Path(__file__).parent / "scripts" / "grad_cases.py"
CASES = ("sparse", "lazy", "thaw")
STRATEGIES = {"mirrored_cpu_2": 2, "multi_worker_2": 2}


def _script():
    spec = importlib.util.spec_from_file_location("_grad_cases_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    script = _script()
    with torch.random.fork_rng(devices=[]):
        return {case: script.train(case, None).state_dict() for case in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def command(name: str, out: Path) -> list[str]:
        return strategies.COMBINATIONS[name].command(str(SCRIPT), str(out), name)

    return jobs_on_first_use(tmp_path_factory, "gradcases", command, timeout=240)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("case", CASES)
def test_the_case_trains_as_on_one_device(runs, reference, name, case):
    folder = runs(name) / case
    for rank in range(STRATEGIES[name]):
        error = folder / f"error_{rank}.txt"
        assert not error.exists(), error.read_text()
        got = torch.load(folder / f"params_{rank}.pt", weights_only=True)
        diffs = {k: float((got[k] - v).abs().max()) for k, v in reference[case].items()}
        assert max(diffs.values()) < 1e-5, (case, rank, diffs)


def test_central_storage_refuses_a_sparse_gradient_by_name(runs):
    """CentralStorage reduces its gradients to the chief, which cannot sum sparse ones: a typed error
    at the first step naming the parameter and the fix, on every replica."""
    folder = runs("central_storage_cpu_2") / "sparse"
    for rank in range(2):
        text = (folder / f"error_{rank}.txt").read_text()
        assert text.startswith("SparseGradientError: Embedding.weight"), text
        assert "MirroredStrategy" in text and "sparse=False" in text, text
