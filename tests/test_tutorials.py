"""TensorFlow's distributed-training tutorials, ported with the rename (examples/tutorials/), each
run under the strategy the tutorial uses and checking at its end that it trained correctly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import free_ports, run_job, run_jobs, tf_config

TUTORIALS = Path(__file__).parent.parent / "examples" / "tutorials"
ENV = {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
OK = "TUTORIAL OK"


def _mirrored(tmp_path, name, n=2, timeout=240):
    cmd = [sys.executable, "-m", "phalanx.cli", "run", "-n", str(n), str(TUTORIALS / name)]
    res = run_job(cmd, timeout=timeout, cwd=tmp_path, env=ENV)
    assert res.returncode == 0, res.logs()[-8000:]
    assert OK in res.output
    return res


def _multi_worker(tmp_path, name, n=2, timeout=240):
    workers = [f"127.0.0.1:{p}" for p in free_ports(n)]
    cmd = [sys.executable, str(TUTORIALS / name)]
    results = run_jobs([(cmd, {**ENV, **tf_config(workers, i)}) for i in range(n)], timeout=timeout, cwd=tmp_path)
    for r in results:
        assert r.returncode == 0, r.output[-6000:]
        assert OK in r.output
    return results


def test_keras(tmp_path):
    _mirrored(tmp_path, "keras_tutorial.py")


def test_multi_worker_with_keras(tmp_path):
    _multi_worker(tmp_path, "multi_worker_with_keras.py")


# The custom loop computes its loss from the logits, as TF does (see note 6 in the tutorial): with
# Keras 3's torch BinaryCrossentropy on the sigmoid's probabilities it learned in some runs only.
def test_parameter_server_training(tmp_path):
    pytest.importorskip("grpc")
    pytest.importorskip("cloudpickle")
    res = run_job([sys.executable, str(TUTORIALS / "parameter_server_training.py")], timeout=240, cwd=tmp_path, env=ENV)
    assert res.returncode == 0, res.logs()[-8000:]
    assert OK in res.output


def test_custom_training(tmp_path):
    _mirrored(tmp_path, "custom_training.py")


def test_input(tmp_path):
    _mirrored(tmp_path, "input.py")


def test_keras_io_distributed_training(tmp_path):
    _mirrored(tmp_path, "keras_io_distributed_training.py")


def test_multi_worker_with_ctl(tmp_path):
    _multi_worker(tmp_path, "multi_worker_with_ctl.py")


def test_save_and_load(tmp_path):
    _mirrored(tmp_path, "save_and_load.py")


def test_distributed_training_guide(tmp_path):
    _mirrored(tmp_path, "distributed_training_guide.py")
