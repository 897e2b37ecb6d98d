"""CentralStorageStrategy: equivalence, one copy of the variables, and a replica dying mid-step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import phalanx as px
from conftest import run_job

SCRIPTS = Path(__file__).parent / "scripts"


def test_defaults_and_placement_single_process():
    strategy = px.CentralStorageStrategy(["cpu:0"])
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.parameter_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    assert px.experimental.CentralStorageStrategy is px.CentralStorageStrategy
    with pytest.raises(px.errors.InvalidDeviceError):
        px.CentralStorageStrategy(["cpu:0", "cpu:0"])


def test_one_copy_of_variables_and_optimizer_state(tmp_path):
    """3 replicas, a 64 MB model, SGD with momentum: the job grows by ~one copy, not three."""
    figures = {}
    for kind in ("central", "mirrored"):
        res = run_job([sys.executable, str(SCRIPTS / "memory.py"), str(tmp_path), kind, "3"], timeout=150,
                      cwd=tmp_path)
        assert res.returncode == 0, res.logs()
        figures[kind] = json.loads((tmp_path / f"memory_{kind}.json").read_text())
    params = figures["central"]["param_bytes"]
    growth = {k: (v["after"] - v["before"]) for k, v in figures.items()}
    print(f"\nparameters {params / 2**20:.1f} MiB (+ the same again of momentum); job memory growth with 3 replicas: "
          f"CentralStorage {growth['central'] / 2**20:.1f} MiB, Mirrored {growth['mirrored'] / 2**20:.1f} MiB")
    # one copy of parameters + one of momentum = 2 x params; allow 25% for allocator slack
    assert growth["central"] < 2.5 * params
    assert growth["mirrored"] > 5 * params  # three copies of both, for comparison


def test_replica_dying_mid_step_leaves_last_completed_step(tmp_path, script):
    job = script("""
        import json, os, sys, torch, phalanx as px
        strategy = px.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])
        rank = strategy.extended._comm.rank
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
