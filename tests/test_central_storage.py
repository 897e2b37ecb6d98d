"""CentralStorageStrategy: equivalence, one copy of the variables, a replica dying mid-step, and copy mode
(GPU replicas computing on copies of the CPU variables; forced on CPU replicas with PHALANX_CENTRAL_COPY=1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import phalanx as px

from conftest import run_job

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module", autouse=True)
def _torch_optim_imported():
    # The first optimizer step imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR; do it
    # before the per-test environment check starts (in-process copy-mode test).
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.SGD([p], lr=0.1, momentum=0.9).step()


def test_defaults_and_placement_single_process():
    strategy = px.CentralStorageStrategy(["cpu:0"])
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.parameter_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    assert px.experimental.CentralStorageStrategy is px.CentralStorageStrategy
    with pytest.raises(px.errors.InvalidDeviceError):
        px.CentralStorageStrategy(["cpu:0", "cpu:0"])


def test_one_copy_of_variables_and_optimizer_state(tmp_path):
    """3 replicas, a 64 MB model, SGD with momentum: the job grows by ~one copy, not three."""
    # One job: CentralStorage first (in fresh processes), then Mirrored on the same three processes.
    res = run_job(
        [sys.executable, str(SCRIPTS / "memory.py"), str(tmp_path), "central,mirrored", "3"], timeout=240, cwd=tmp_path
    )
    assert res.returncode == 0, res.logs()
    figures = {kind: json.loads((tmp_path / f"memory_{kind}.json").read_text()) for kind in ("central", "mirrored")}
    params = figures["central"]["param_bytes"]
    growth = {k: (v["after"] - v["before"]) for k, v in figures.items()}
    print(
        f"\nparameters {params / 2**20:.1f} MiB (+ the same again of momentum); job memory growth with 3 replicas: "
        f"CentralStorage {growth['central'] / 2**20:.1f} MiB, Mirrored {growth['mirrored'] / 2**20:.1f} MiB"
    )
    # one copy of parameters + one of momentum = 2 x params; allow 25% for allocator slack
    assert growth["central"] < 2.5 * params
    assert growth["mirrored"] > 5 * params  # three copies of both, for comparison


def test_replica_dying_mid_step_leaves_last_completed_step(tmp_path, script):
    job = script("""
        import json, os, sys, torch, phalanx as px
        strategy = px.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])
        rank = strategy.extended.process_index
        torch.manual_seed(0)
        with strategy.scope():
            model = torch.nn.Linear(8, 1)
            opt = torch.optim.Adam(model.parameters(), lr=0.1)
        def step(i, x):
            loss = px.nn.compute_average_loss(model(x).pow(2).squeeze(1))
            if i == 4 and rank == 2:
                os._exit(9)  # dies after its forward, before the gradient reduction
            opt.zero_grad(); loss.backward(); opt.step()
        completed = None
        try:
            for i, x in enumerate(strategy.experimental_distribute_dataset([torch.randn(6, 8) for _ in range(8)])):
                strategy.run(step, args=(i, x))
                completed = [p.detach().clone() for p in model.parameters()]
        except px.errors.PeerUnavailableError as e:
            same = all(torch.equal(a, b) for a, b in zip(completed, model.parameters()))
            if rank == 0:
                json.dump({"error": str(e), "unchanged": same}, open("central_fault.json", "w"))
            raise
    """)
    res = run_job([sys.executable, str(job)], timeout=90, cwd=tmp_path, env={"PHALANX_COLLECTIVE_TIMEOUT": "5"})
    assert res.returncode != 0
    rec = json.loads((tmp_path / "central_fault.json").read_text())
    assert rec["unchanged"], "central variables were half-updated"
    assert "replica:2" in rec["error"], rec["error"]


def test_a_replica_failing_as_the_variables_are_shared_leaves_nothing_in_dev_shm(tmp_path, script):
    """Replica 0 makes the shared file in /dev/shm and removes it once every replica has mapped
    it; a replica that fails first (here: it cannot open the file) made replica 0's wait raise
    before the removal, and the file stayed in /dev/shm for good (found by tests/test_r.py)."""
    job = script("""
        import json, os, torch, phalanx as px
        strategy = px.CentralStorageStrategy(["cpu:0", "cpu:1"])
        rank = strategy.extended.process_index
        json.dump({"pid": os.getpid()}, open(f"pid_{rank}.json", "w"))
        if rank == 1:
            real_open = os.open
            def refuse(path, *args, **kwargs):
                if "phalanx-central" in str(path):
                    raise PermissionError(13, "refused by the test", str(path))
                return real_open(path, *args, **kwargs)
            os.open = refuse
        with strategy.scope():
            model = torch.nn.Linear(8, 1)
    """)
    res = run_job([sys.executable, str(job)], timeout=90, cwd=tmp_path, env={"PHALANX_COLLECTIVE_TIMEOUT": "5"})
    assert res.returncode != 0, res.logs()
    pid = json.loads((tmp_path / "pid_0.json").read_text())["pid"]
    left = [p for p in os.listdir("/dev/shm") if p.startswith(f"phalanx-central-{pid}-")]
    assert left == [], f"replica 0 (pid {pid}) left {left} in /dev/shm"


# ------------------------------------------------------------------------------------------ copy mode
COPY_ENV = {"PHALANX_CENTRAL_COPY": "1"}


@pytest.fixture(scope="module")
def copy_mode_runs(tmp_path_factory):
    """Per optimizer: 2 replicas in forced copy mode, 20 steps; each replica's records. One job runs
    both optimizers, one after the other, each under a fresh strategy."""
    runs = {}
    root = tmp_path_factory.mktemp("copy")
    res = run_job(
        [sys.executable, str(SCRIPTS / "central_copy.py"), str(root), "sgd,adam", "2"],
        timeout=240,
        cwd=root,
        env=COPY_ENV,
    )
    assert res.returncode == 0, res.logs()
    for opt in ("sgd", "adam"):
        out = root / opt
        runs[opt] = [
            (torch.load(out / f"copy_{r}.pt", weights_only=True), json.loads((out / f"copy_{r}.json").read_text()))
            for r in range(2)
        ]
    return runs


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_copy_mode_matches_one_device(copy_mode_runs, opt):
    (t0, rec0), (t1, rec1) = copy_mode_runs[opt]
    assert rec0["copy_mode"] and rec1["copy_mode"]
    assert rec0["steps"] == rec1["steps"] == 20
    assert rec0["forward_on_compute_copy"] and rec1["forward_on_compute_copy"], "forward did not use the copy"
    diff = _max_diff(t0["computed"], t0["reference"])
    print(f"\ncentral copy mode x2, {opt}: max |param - one-device param| = {diff:.3g}")
    assert diff < 1e-5
    assert _max_diff(t0["outside"], t0["reference"]) < 1e-5  # what a checkpoint outside run would save
    for key in t0["computed"]:  # every replica computes with the same values
        assert torch.equal(t0["computed"][key], t1["computed"][key]), f"replicas' compute copies differ: {key}"
        assert torch.equal(t0["computed"][key], t0["outside"][key]), f"compute copy differs from central: {key}"
    assert rec0["outside_on_central"] and rec1["outside_on_central"]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_copy_mode_optimizer_state_once_on_the_cpu(copy_mode_runs, opt):
    (_, chief), (_, other) = copy_mode_runs[opt]
    assert chief["step_on_central_copy"], "the chief's optimizer did not update the central copy"
    assert chief["step_devices"] == ["cpu"]
    assert chief["params_with_state"] == chief["num_params"] and chief["state_devices"] == ["cpu"]
    param_bytes = 4 * (10 * 32 + 32 + 32 * 16 + 16 + 16 + 1)
    # SGD: one momentum buffer per parameter; Adam: two moments (+ a scalar step per parameter)
    assert chief["state_bytes"] == {"sgd": param_bytes, "adam": 2 * param_bytes + 4 * 6}[opt]
    assert other["params_with_state"] == 0 and other["state_bytes"] == 0
    cpu = "/job:localhost/replica:0/task:0/device:CPU:"
    assert chief["parameter_devices"] == [cpu + "0"] and chief["worker_devices"] == [cpu + "0", cpu + "1"]


def test_copy_mode_single_replica_in_process(monkeypatch):
    """One replica in copy mode (a GPU with parameter_device='cpu'): the same hand-over, no peers."""
    monkeypatch.setenv("PHALANX_CENTRAL_COPY", "1")
    strategy = px.CentralStorageStrategy(["cpu:0"], parameter_device="cpu")
    assert strategy.extended.copy_mode
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    central = {id(p): strategy.extended.central_copy_of(p).data_ptr() for p in model.parameters()}
    in_run = []

    def step(x):
        in_run.append(all(p.data_ptr() != central[id(p)] for p in model.parameters()))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        x = torch.randn(8, 4)
        strategy.run(step, args=(x,))
        ref_loss = ref(x).pow(2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    assert in_run == [True] * 3
    assert all(p.data_ptr() == central[id(p)] for p in model.parameters())  # outside run: the central copy
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))
    with torch.no_grad():  # a write outside run (a restore) changes the central copy, seen by the next run
        model.weight.fill_(0.5)
    seen = strategy.run(lambda: model.weight.detach().clone())
    assert torch.equal(seen, torch.full((2, 4), 0.5))
    strategy.close()


def test_copy_mode_switch_is_checked(monkeypatch):
    monkeypatch.setenv("PHALANX_CENTRAL_COPY", "yes")
    with pytest.raises(px.errors.ClusterSpecError, match="PHALANX_CENTRAL_COPY"):
        px.CentralStorageStrategy(["cpu:0"])
