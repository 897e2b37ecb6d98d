"""Programs that train on one device and once failed under MirroredStrategy(["cpu:0", "cpu:1"]) (issue 50),
written from a user's side before the reducer was rewritten; each must now equal one device.

Each test runs ``scripts/reducer_gaps.py`` (a real two-replica job) and requires the parameters to
equal one device's. What failed, and how it is met now:

- sparse gradients (``nn.Embedding(sparse=True)`` + ``SparseAdam``) raised ``RuntimeError: Cannot
  access data pointer of Tensor that doesn't have storage`` in the reducer; they are now summed by
  gathering every replica's indices and values (TF reduces ``IndexedSlices`` so);
- a lazy module (``nn.LazyLinear`` built in ``scope()``, materialised by the first forward inside
  ``run``) raised ``ValueError: Attempted to use an uninitialized parameter``; it is now
  synchronised when it materialises, before that forward uses its values;
- a layer thawed (``requires_grad_(True)``) inside the step function joined no gradient
  synchronisation that step (``ReplicaDivergenceError`` at the next); it now joins in that step.

``tests/test_grad_cases.py`` covers the same three with other optimizers and MultiWorkerMirrored.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import jobs_on_first_use

SCRIPT = Path(__file__).parent / "scripts" / "reducer_gaps.py"

# Before the per-test environment check: torch's first optimizer step sets TORCHINDUCTOR_CACHE_DIR.
_p = torch.nn.Parameter(torch.zeros(1))
_p.grad = torch.zeros(1)
torch.optim.SGD([_p], lr=0.1).step()


def _script():
    spec = importlib.util.spec_from_file_location("_reducer_gaps_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def command(scenario: str, out: Path) -> list[str]:
        return [sys.executable, str(SCRIPT), str(out), scenario]

    return jobs_on_first_use(tmp_path_factory, "reducer_gaps", command, timeout=180)


def _check(runs, scenario: str) -> None:
    with torch.random.fork_rng(devices=[]):
        reference = _script().train(None, scenario)
    folder = runs(scenario)
    for rank in range(2):
        record = json.loads((folder / f"{scenario}_{rank}.json").read_text())
        assert "error" not in record, f"replica {rank}: {record}"
        for name, want in reference.items():
            got = torch.tensor(record["params"][name])
            diff = float((got - torch.tensor(want)).abs().max())
            assert diff < 1e-5, (rank, name, diff)


def test_sparse_embedding_with_sparse_adam_trains_as_on_one_device(runs):
    _check(runs, "sparse")


def test_lazy_linear_materialised_inside_run_trains_as_on_one_device(runs):
    _check(runs, "lazy")


def test_layer_thawed_inside_the_step_trains_as_on_one_device(runs):
    _check(runs, "thaw")
