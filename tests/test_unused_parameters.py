"""A parameter that no replica used in a step is left alone, as on one device, under DDP and in TF.

One device leaves such a parameter's ``.grad`` as it was (None after ``zero_grad()``), so the
optimizer skips it: SGD's momentum does not keep moving it, AdamW does not decay it. A parameter
used on some replicas only gets the summed gradient (DDP with ``find_unused_parameters``). The
script trains a small mixture of experts with an auxiliary head used every other step
(``tests/scripts/unused_params.py``) under each synchronous strategy and on one device.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import strategies
from conftest import jobs_on_first_use

SCRIPT = Path(__file__).parent / "scripts" / "unused_params.py"
OPTIMIZERS = ("sgd_momentum", "adam", "adamw")
# Every synchronous strategy that all-reduces gradients, with the replicas each one has.
CASES = {
    "mirrored_cpu_2": 2,
    "central_storage_cpu_2": 2,
    "multi_worker_2": 2,
    "mirrored_cpu_3": 3,
    "fully_sharded_cpu_2": 2,
}


def _script():
    spec = importlib.util.spec_from_file_location("_unused_params_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    """Plain torch on one device, per optimizer: (final parameters, per-step names with no gradient)."""
    script = _script()
    out = {}
    with torch.random.fork_rng(devices=[]):
        for opt in OPTIMIZERS:
            model, seen = script.train(None, opt)
            out[opt] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, seen)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def command(name: str, out: Path) -> list[str]:
        return strategies.COMBINATIONS[name].command(str(SCRIPT), str(out), name)

    return jobs_on_first_use(tmp_path_factory, "unused", command, timeout=240)


def test_the_data_leaves_parameters_unused_on_one_device(reference):
    """The reproduction is what it claims: some steps leave expert_b and the auxiliary head without
    a gradient on one device, and the step that splits the batch between the experts uses both."""
    _, seen = reference["sgd_momentum"]
    assert seen[0] == ["expert_b.bias", "expert_b.weight"]
    assert seen[1] == ["aux.bias", "aux.weight"]
    assert seen[2] == []
    assert seen[3] == ["aux.bias", "aux.weight", "expert_b.bias", "expert_b.weight"]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_unused_parameters_train_as_on_one_device(runs, reference, name, opt):
    folder = runs(name) / f"{name},{opt}"
    ref_params, ref_seen = reference[opt]
    for rank in range(CASES[name]):
        got = torch.load(folder / f"params_{rank}.pt", weights_only=True)
        diffs = {k: float((got[k] - ref_params[k]).abs().max()) for k in ref_params}
        assert max(diffs.values()) < 1e-5, (rank, diffs)
        seen = json.loads((folder / f"grads_{rank}.json").read_text())
        if name.startswith("central_storage") and rank != 0:
            # CentralStorage: only the chief keeps the summed gradients and updates the one copy.
            assert all(len(step) == len(ref_params) for step in seen), seen
        else:
            # None exactly where one device has None: unused everywhere. A parameter used on one
            # replica only (step 1: each expert on its own half of the batch) has its summed gradient.
            assert seen == ref_seen, (rank, seen)


@pytest.mark.skipif(sys.platform != "linux", reason="replica processes")
def test_a_parameter_unused_in_a_later_pass_keeps_its_accumulated_gradient(script, python, tmp_path):
    """Gradient accumulation: a pass that does not use a parameter leaves what earlier passes summed
    into its ``.grad`` (one device adds nothing to it), rather than adding a zero or resetting it."""
    path = script(
        """
        import torch, phalanx as px
        strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            torch.manual_seed(0)
            a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
        x = torch.ones(2, 3)
        def first():
            px.nn.compute_average_loss((a(x) + b(x)).squeeze(1), global_batch_size=4).backward()
        def second():
            px.nn.compute_average_loss(a(x).squeeze(1), global_batch_size=4).backward()
        strategy.run(first)
        b_after_first = b.weight.grad.clone()
        strategy.run(second)
        assert torch.equal(b.weight.grad, b_after_first), (b.weight.grad, b_after_first)
        # a is used by both passes: the second added its summed gradient (4 examples of ones / 4).
        assert torch.allclose(a.weight.grad, torch.full((1, 3), 2.0)), a.weight.grad
        b.weight.grad = None
        strategy.run(second)
        assert b.weight.grad is None
        print("OK", strategy.extended.replica_id)
        """
    )
    from conftest import run_job

    res = run_job([python, str(path)], timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.logs()
    assert "OK 0" in res.output
