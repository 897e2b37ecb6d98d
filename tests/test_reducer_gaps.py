"""Programs that train on one device and fail under MirroredStrategy(["cpu:0", "cpu:1"]) (issue 50):
reproductions for the gradient reducer's owner (``src/phalanx/comm/reducer.py`` is being rewritten).

Each test runs ``scripts/reducer_gaps.py`` (a real two-replica job) and requires the parameters to
equal one device's. They are expected to fail today (``xfail(strict=True)``: one that starts to
pass fails the run, so the mark is removed with the fix). What fails today, and where:

- sparse gradients (``nn.Embedding(sparse=True)`` + ``SparseAdam``): at step 1, on both replicas,
  ``RuntimeError: Cannot access data pointer of Tensor that doesn't have storage`` raised at
  ``phalanx/comm/reducer.py:128`` (``_aliases``, reading the data pointer of the sparse ``.grad``);
  DDP all-reduces sparse gradients, TF reduces ``IndexedSlices``;
- a lazy module (``nn.LazyLinear`` built in ``scope()``, materialised by the first forward inside
  ``run``): before the first step (leaving the scope), ``ValueError: Attempted to use an
  uninitialized parameter in <method 'numel' ...>`` at ``phalanx/comm/reducer.py:199`` (the
  bucket sizes summed over an ``UninitializedParameter``); Keras layers, lazy the same way, work;
- a layer thawed (``requires_grad_(True)``) inside the step function at step 4 (index 3): its
  parameters join no gradient synchronisation that step, so the replicas' copies part:
  ``ReplicaDivergenceError: Replicas diverged at step 5 ... first differing parameter: Linear.bias``
  (from ``phalanx/comm/guard.py:149``); thawed between steps it matches one device.

(Line numbers as of main at a8023bd.)
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


@pytest.mark.xfail(strict=True, reason="sparse gradients: the reducer copies .grad into dense buckets (issue 50)")
def test_sparse_embedding_with_sparse_adam_trains_as_on_one_device(runs):
    _check(runs, "sparse")


@pytest.mark.xfail(
    strict=True, reason="lazy modules: the reducer sizes buckets from uninitialized parameters (issue 50)"
)
def test_lazy_linear_materialised_inside_run_trains_as_on_one_device(runs):
    _check(runs, "lazy")


@pytest.mark.xfail(strict=True, reason="a parameter thawed inside run joins no gradient synchronisation (issue 50)")
def test_layer_thawed_inside_the_step_trains_as_on_one_device(runs):
    _check(runs, "thaw")
