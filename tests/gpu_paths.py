"""Checks shared by tests/test_gpu.py (on a GPU) and tests/test_gpu_paths_on_cpu.py (CPU replicas, in CI).

Each runs ``tests/scripts/gpu_job.py`` as a real job and checks what it wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from conftest import run_job

JOB = Path(__file__).parent / "scripts" / "gpu_job.py"


def _device_env(device: str) -> dict[str, str]:
    # The CPU twins hide the GPU altogether on a GPU host: MultiWorkerMirroredStrategy with RING
    # shares whatever GPU it sees.
    return {"PHALANX_GPU_JOB_DEVICE": device, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}


def check_single_replica_collectives(tmp_path: Path, *, backend: str, device: str) -> dict:
    """Mirrored, CentralStorage and FullySharded strategies of one replica, with the process group built anyway."""
    res = run_job(
        [sys.executable, str(JOB), "nccl1", str(tmp_path)],
        timeout=240,
        cwd=tmp_path,
        # The guard on every pass (a GPU's default is every 8th, docs/gpu.md): it must ride on the
        # NCCL path's first bucket at each step, which the guard_checks below count.
        env={"PHALANX_SINGLE_REPLICA_COLLECTIVES": "1", "PHALANX_GUARD_EVERY": "1", **_device_env(device)},
        fresh=True,  # a CUDA process is never forked from a server
    )
    assert res.returncode == 0, res.output
    result = json.loads((tmp_path / "nccl1_0.json").read_text())
    for kind in ("mirrored", "central_storage", "fully_sharded"):
        r = result[kind]
        assert r["sharded"] == (kind == "fully_sharded"), r
        assert (r["communicator"], r["backend"], r["world_size"]) == ("ProcessGroupCommunicator", backend, 1), r
        assert r["param_device"].startswith(device), r
        assert r["error"] is None, r
        # Equal to plain torch on one device: the sum over one replica is exact.
        assert r["max_diff"] < 1e-6, r
        # The guard rode on every step's first bucket (CentralStorage checks it in a collective of its own too).
        assert r["guard_checks"] >= 6, r
        assert r["cpu_sum"] == [1.0, 1.0] and r["gpu_sum"] == [1.0, 1.0], r
    return result


def check_shared_device(tmp_path: Path, *, device: str, late_by: int) -> list[dict]:
    """Two replica processes on one device over gloo: equal to one device; divergence named; checkpoint moves."""
    res = run_job(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "run",
            "-n",
            "2",
            "--start-method",
            "spawn",
            str(JOB),
            "shared",
            str(tmp_path),
        ],
        timeout=300,
        cwd=tmp_path,
        env=_device_env(device),
        fresh=True,
    )
    assert res.returncode == 0, res.output
    results = [json.loads((tmp_path / f"shared_{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["param_device"].startswith(device) and r["backend"] == "gloo" and r["world_size"] == 2, r
        assert r["error"] is None and r["max_diff"] < 1e-5, r
        # Replica 1 changed its weights before step 2: every replica names it, at most `late_by` steps later.
        assert r["divergence"] is not None, r
        assert r["divergence"].startswith(f"ReplicaDivergenceError at step {2 + late_by}:"), r["divergence"]
        assert "first differing parameter" in r["divergence"], r["divergence"]
    assert results[0]["params"] == results[1]["params"]
    # Written from the replicas' device, read back on the CPU by plain torch.
    from phalanx.checkpoint import load_state

    state = load_state(results[0]["checkpoint"])["model"]
    restored = [t.tolist() for t in state.values()]
    assert all(t.device.type == "cpu" for t in state.values())
    assert restored == results[0]["params"]
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model.load_state_dict(state)
    return results
