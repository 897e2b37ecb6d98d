"""Callbacks under two replicas: writers run on the chief only; a stop on one replica stops all."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import free_ports, run_job, run_jobs, tf_config

SCRIPT = Path(__file__).parent / "scripts" / "keras_callbacks.py"
# One thread per process: on a small shared CI host, OpenMP pools of several processes (two
# "workers" on one host, or other jobs) fight over the cores and a step can take 10x longer.
ENV = {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}


def _run(mode: str, out: Path) -> tuple[str, str]:
    """Returns (the chief's output, the other replica's output)."""
    if mode == "mirrored":
        res = run_job([sys.executable, str(SCRIPT), str(out), "mirrored"], timeout=120, cwd=out, env=ENV)
        assert res.returncode == 0, res.logs()[-8000:]
        (log,) = res.log_dir.rglob("replica_1.log")
        return res.output, log.read_text(errors="replace")
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    jobs = [([sys.executable, str(SCRIPT), str(out), "mwms"], {**ENV, **tf_config(workers, i)}) for i in range(2)]
    results = run_jobs(jobs, timeout=120, cwd=out)
    assert all(r.returncode == 0 for r in results), [r.output[-4000:] for r in results]
    return results[0].output, results[1].output


@pytest.mark.parametrize("mode", ["mirrored", "mwms"])
def test_writers_once_and_stopping_agreed(tmp_path, mode):
    chief_out, other_out = _run(mode, tmp_path)
    results = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(2)]
    # EarlyStopping on replica 1 alone stopped both replicas after epoch 2 (of 6): no hang.
    assert results[0] == results[1]
    assert results[0]["first"]["epochs"] == [0, 1]
    assert results[0]["first"]["iterations"] == 2 * 10
    # A batch-level stop on the chief alone: 4 more steps on both replicas, then both stopped.
    assert results[0]["second"] == {"epochs": [0], "iterations": 24}
    # ModelCheckpoint saved on the chief only, once per epoch, each file written by one process.
    assert (tmp_path / "saves_rank0.txt").read_text().split() == ["0", "1"]
    assert not (tmp_path / "saves_rank1.txt").exists()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.weights.h5")) == ["ckpt-01.weights.h5", "ckpt-02.weights.h5"]
    # TensorBoard wrote from the chief only.
    events = sorted(p.name for p in (tmp_path / "tb").rglob("events.out.*"))
    assert events and all(name.startswith("events.out.rank0.") for name in events), events
    # The progress bar is the chief's alone.
    assert "Epoch 1/6" in chief_out and "Epoch 2/6" in chief_out and "Epoch 3/6" not in chief_out
    assert "Epoch 1/" not in other_out
