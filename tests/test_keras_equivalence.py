"""Keras fit / evaluate / predict under every strategy equal one-device Keras on the same global batch.

One script run per strategy (one for both two-CPU strategies) covers every case of ``scripts/keras_equivalence.py``: Sequential with
SGD + momentum + L2 and a final batch of one row (replicas without rows), functional with Adam and
validation_split, a lazily built subclassed model on a torch DataLoader with validation_data, a
PyDataset, a Sequential without input shape, Keras 3's ``gradient_accumulation_steps`` with
SGD-momentum and with Adam; each followed by evaluate and predict on 101 rows in batches of 20
(the last batch has one row).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import free_ports, run_job, run_jobs, tf_config

SCRIPT = Path(__file__).parent / "scripts" / "keras_equivalence.py"
# One thread per process: on a small shared CI host, OpenMP pools of several processes (two
# "workers" on one host, or other jobs) fight over the cores and a step can take 10x longer.
ENV = {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
COMPARED = [
    "sgd",
    "adam",
    "subclassed_dataloader",
    "pydataset",
    "lazy_sequential",
    "accumulate_sgd",
    "accumulate_adam",
    "fine_tune",
]
ALL = COMPARED + ["batchnorm"]
TOL = 1e-5


def _load(out: Path, prefix: str, case: str, rank: int) -> tuple[dict, dict]:
    arrays = dict(np.load(out / f"{prefix}_{case}_{rank}.npz"))
    return arrays, json.loads((out / f"{prefix}_{case}_{rank}.json").read_text())


def _diffs(a: tuple[dict, dict], b: tuple[dict, dict]) -> dict[str, float]:
    (wa, ja), (wb, jb) = a, b
    assert ja["history"].keys() == jb["history"].keys() and ja["evaluate"].keys() == jb["evaluate"].keys()
    out = {
        "weights": max(float(np.abs(wa[k] - wb[k]).max()) for k in wb if k.startswith("w")),
        "predict": float(np.abs(wa["predictions"] - wb["predictions"]).max()),
    }
    for key, values in jb["history"].items():
        out[f"history.{key}"] = max(abs(x - y) for x, y in zip(ja["history"][key], values, strict=True))
    for key, value in jb["evaluate"].items():
        out[f"evaluate.{key}"] = abs(ja["evaluate"][key] - value)
    return out


TWO_CPU_MODES = ["mirrored", "central_storage"]


@pytest.fixture(scope="module")
def two_cpu_job(tmp_path_factory) -> tuple[Path, str]:
    """ONE job: plain Keras and OneDeviceStrategy on the first process alone, then both two-CPU-replica
    strategies one after the other on it and the replica it starts. (output directory, failure log)"""
    out = tmp_path_factory.mktemp("keras-two-cpus")
    mode = ",".join(["reference", *TWO_CPU_MODES])
    res = run_job([sys.executable, str(SCRIPT), str(out), mode], timeout=150 + 240, cwd=out, env=ENV)
    return out, "" if res.returncode == 0 else f"the job exited {res.returncode}\n{res.logs()[-8000:]}"


@pytest.fixture(scope="module")
def reference(two_cpu_job) -> Path:
    """Plain Keras and OneDeviceStrategy, in one process (the first of the two-CPU job)."""
    out, failure = two_cpu_job
    missing = [
        f"{p}_{case}_0.json" for p in ("ref", "one") for case in ALL if not (out / f"{p}_{case}_0.json").exists()
    ]
    assert not missing, (missing, failure)
    return out


def _check_against_reference(out: Path, ref: Path, prefix: str, world: int) -> None:
    worst: dict[str, float] = {}
    for case in COMPARED:
        replicas = [_load(out, prefix, case, r) for r in range(world)]
        diffs = _diffs(replicas[0], _load(ref, "ref", case, 0))
        print(f"\n{prefix} x{world} {case}: " + ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()))
        for key, value in diffs.items():
            worst[key.split(".")[0] if key.startswith("evaluate") else key] = max(worst.get(key, 0.0), value)
        assert all(v < TOL for v in diffs.values()), (case, diffs)
        assert replicas[0][0]["predictions"].shape == (101, 3), "predict must return each of the 101 rows once"
    for case in ALL:
        replicas = [_load(out, prefix, case, r) for r in range(world)]
        for other in replicas[1:]:
            # Every replica holds the same weights and reports the same (global) losses and metrics.
            assert all(np.array_equal(replicas[0][0][k], other[0][k]) for k in replicas[0][0]), case
            assert replicas[0][1] == other[1], case
    print(f"\n{prefix} x{world}, worst over cases: " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()))


def test_one_device_strategy_is_plain_keras(reference):
    for case in ALL:
        diffs = _diffs(_load(reference, "one", case, 0), _load(reference, "ref", case, 0))
        assert all(v == 0.0 for v in diffs.values()), (case, diffs)


@pytest.fixture(scope="module")
def two_cpu_replicas(two_cpu_job, reference) -> Path:
    out, failure = two_cpu_job
    assert not failure, failure
    return out


@pytest.mark.parametrize("mode", TWO_CPU_MODES)
def test_two_cpu_replicas_match_one_device(two_cpu_replicas, reference, mode):
    _check_against_reference(two_cpu_replicas, reference, mode, 2)


def test_multi_worker_two_workers_tf_config_match_one_device(tmp_path, reference):
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    jobs = [([sys.executable, str(SCRIPT), str(tmp_path), "mwms"], {**ENV, **tf_config(workers, i)}) for i in range(2)]
    results = run_jobs(jobs, timeout=150, cwd=tmp_path)
    assert all(r.returncode == 0 for r in results), [r.output[-4000:] for r in results]
    _check_against_reference(tmp_path, reference, "mwms", 2)
