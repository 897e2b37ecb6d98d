"""Every parameter created in ``scope()`` is captured, and replicas that drift apart are stopped (issue 28).

One 2-replica MirroredStrategy job (tests/scripts/capture.py) runs every check; each test asserts
on its part. Each capture check starts the replicas from different random seeds, so only a
capture (broadcast from replica 0, gradients summed) makes them train as one device does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_job

SCRIPT = Path(__file__).parent / "scripts" / "capture.py"
EVERY = 3  # PHALANX_FINGERPRINT_EVERY for the job: small, so drift is caught within a few steps


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("capture")
    res = run_job(
        [sys.executable, str(SCRIPT), str(out)],
        timeout=240,
        cwd=out,
        env={"OMP_NUM_THREADS": "1", "PHALANX_FINGERPRINT_EVERY": str(EVERY)},
    )
    return res, out


@pytest.fixture(scope="module")
def results(job):
    res, out = job
    files = [out / f"capture_{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), res.logs()[-6000:]
    return [json.loads(f.read_text()) for f in files]


def _trained_as_one_device(results, name):
    for got in results:
        part = got[name]
        assert "error" not in part, f"{part['error']}: {part['text']}\n{part.get('tb', '')}"
        assert part["replicas_equal"], f"{name}: the replicas' parameters differ after 3 steps"
        assert part["same_names_as_one_device"], part["names"]
        assert part["max_diff_to_one_device"] < 1e-5, f"{name}: not the one-device result"


@pytest.mark.parametrize(
    "name",
    [
        "deepcopy_sequential",
        "transformer_encoder",
        "clone_parameter_in_scope",
        "clone_parameter_after_scope",
        "meta_to_empty_in_scope",
        "meta_to_empty_after_scope",
        "load_state_dict_assign_in_scope",
        "load_state_dict_assign_after_scope",
        "meta_then_assign_in_scope",
        "functional_call",
    ],
)
def test_parameters_made_in_scope_are_captured_and_train_as_one_device(results, name):
    _trained_as_one_device(results, name)


def test_a_standalone_deep_copy_made_in_scope_is_adopted_at_its_first_call(results):
    # TF mirrors a copied distributed variable; here the copy is broadcast and its gradients summed.
    for got in results:
        assert got["standalone_deepcopy"] == {"replicas_equal": True}, got["standalone_deepcopy"]


def test_a_parameter_of_no_module_is_named_at_its_optimizers_first_step(results):
    for got in results:
        part = got["free_parameter_refused"]
        assert part.get("error") == "UnsynchronizedParameterError", part
        assert "updated by SGD" in part["text"] and "phalanx.Variable" in part["text"], part["text"]


def test_its_port_phalanx_variable_trains_as_on_one_device(results):
    for got in results:
        part = got["free_variable_trains"]
        assert part["values"] == pytest.approx([part["one_device"]] * 2, abs=1e-6), part


def test_a_parameter_truly_created_outside_scope_is_still_refused(results):
    for got in results:
        part = got["outside_scope_still_refused"]
        assert part.get("error") == "UnsynchronizedParameterError", part
        assert part["parameter"].startswith("Linear.weight"), part
        assert "outside strategy.scope()" in part["text"], part["text"]


def test_a_seeded_model_built_outside_scope_is_refused_for_what_is_true_of_it(results):
    """Its replicas start equal (a seed): the error must not say they start different, but that its
    gradients are never summed, so the replicas' copies part from the first step."""
    for got in results:
        part = got["outside_scope_seeded"]
        assert part.get("error") == "UnsynchronizedParameterError", part
        text = part["text"]
        assert "initialised it differently" not in text and "start different on every replica" not in text, text
        assert "gradients are never summed" in text and "seed" in text, text


def test_a_replica_training_with_another_learning_rate_is_stopped_within_n_steps(job, results):
    res, out = job
    assert res.returncode != 0, "the drifting job must fail"
    drift = [json.loads((out / f"drift_{r}.json").read_text()) for r in range(2)]
    for d in drift:
        assert d.get("raised"), d
        assert d["type"] == "ReplicaDivergenceError", d
        assert d["field"] == "parameters", d
        assert d["replicas"][0].startswith("replica:0") and d["replicas"][1].startswith("replica:1"), d
        # The replicas' updates differ from the first step on; the next due fingerprint sees it.
        assert 1 < d["at"] - d["start"] <= EVERY + 1, d
    assert drift[0]["at"] == drift[1]["at"], "both replicas stop at the same step"
    assert "ReplicaDivergenceError" in res.logs()


def test_a_scope_for_another_device_makes_tensors_where_torch_would_and_moves_them():
    """Issue 44: scope() does not make torch create tensors on the replica's device (a GPU's own
    random generator would give other initial weights than the same program on a CPU, or than
    Model().to(device)); it moves what modules register. Checked with a capture for a device this
    machine may not have: entering it changes torch's default device for nobody."""
    import torch

    from phalanx.core.capture import Capture, capture

    seen = []
    spec = Capture(object(), torch.device("cuda:0"), seen.append, seen.append)
    before = torch.get_default_device()
    with capture(spec):
        assert torch.get_default_device() == before
        assert torch.empty(1).device == before
    assert seen == []


def test_the_guard_fingerprints_again_every_n_steps():
    from types import SimpleNamespace

    import torch

    from phalanx.comm.guard import FIELDS, ReplicaGuard

    step = [0]
    comm = SimpleNamespace(rank=0, world_size=2, name=lambda r: f"replica:{r}")
    guard = ReplicaGuard(comm, lambda: (step[0], 8, step[0]), lambda: [("w", torch.ones(3))], every=3)
    slot = FIELDS.index("parameters")
    fingerprinted = []
    for step[0] in range(1, 11):
        if guard.encode(torch.float64)[slot]:
            fingerprinted.append(step[0])
    assert fingerprinted == [1, 4, 7, 10]
    guard.fingerprint_due = True  # a restore: at once, and N steps on from there
    for step[0] in range(11, 16):
        if guard.encode(torch.float64)[slot]:
            fingerprinted.append(step[0])
    assert fingerprinted == [1, 4, 7, 10, 11, 14]


def test_fingerprint_every_is_a_setting_and_a_knob():
    import phalanx as px
    from phalanx.config import FINGERPRINT_EVERY, Settings
    from phalanx.errors import ClusterSpecError

    assert Settings.from_environ({}).fingerprint_every == FINGERPRINT_EVERY
    assert Settings.from_environ({"PHALANX_FINGERPRINT_EVERY": "0"}).fingerprint_every == 0
    with pytest.raises(ClusterSpecError, match="PHALANX_FINGERPRINT_EVERY"):
        Settings.from_environ({"PHALANX_FINGERPRINT_EVERY": "-1"})
    strategy = px.OneDeviceStrategy("cpu:0")
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
            strategy.extended.set_consistency_checks(True, fingerprint_every=bad)
    strategy.extended.set_consistency_checks(True, fingerprint_every=5)


def test_a_parameter_made_on_the_host_in_a_device_scope_is_moved_after_its_module_drew_it(monkeypatch, tmp_path):
    """Issue 44, found on an H200: nn.Linear registers its weight, then draws its values
    (reset_parameters); moved at registration, the weight got them from the GPU's generator, so a
    model built in a GPU scope differed from plain ``Model().to("cuda")`` with the same seed (the
    GPU test, tests/test_gpu.py, checks the values). Here, the logic on a CPU: a scope whose device
    differs from the host's (``cpu:0``, a device this machine has) leaves the parameter where it
    was made until the sweep (the module's first call, or scope exit), and moves it in place, so
    an optimizer made in scope holds the moved parameter."""
    import torch

    import phalanx as px

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # torch's optimizer import sets it otherwise
    strategy = px.OneDeviceStrategy("cpu")
    books = strategy.extended.variable_sync
    books._device = torch.device("cpu", 0)  # not equal to torch.device("cpu"): "another device"
    try:
        torch.manual_seed(5)
        plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        torch.manual_seed(5)
        with strategy.scope():
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
            weight = model[0].weight
            assert not books.created_in_scope(weight)  # waits for the sweep: not moved at registration
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.ones(2, 4))  # its first call sweeps first
            assert books.created_in_scope(weight)
            assert [books.created_in_scope(p) for p in model.parameters()] == [True] * 4
        assert model[0].weight is weight and opt.param_groups[0]["params"][0] is weight
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a, b)
        # A module made in scope and never called is swept at scope exit.
        with strategy.scope():
            late = torch.nn.Linear(3, 3)
            assert not books.created_in_scope(late.weight)
        assert books.created_in_scope(late.weight) and books.created_in_scope(late.bias)
    finally:
        strategy.close()
