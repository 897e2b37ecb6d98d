"""TensorFlow's distributed-training tutorials, ported with the rename (examples/tutorials/), each
run under the strategy the tutorial uses and checking at its end that it trained correctly.

The tutorials that run on the same launcher run one after the other in ONE job (one ``phalanx run
-n 2`` for the MirroredStrategy ones, one pair of TF_CONFIG workers for the multi-worker ones),
each as ``python TUTORIAL`` would run it (``scripts/run_programs.py``): a Keras process costs ~7 s
of CPU to start, more than most tutorials' training. Each test checks its own tutorial's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import RUN_PROGRAMS, free_ports, program_output, programs_job_env, run_job, run_jobs, tf_config

TUTORIALS = Path(__file__).parent.parent / "examples" / "tutorials"
ENV = {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
OK = "TUTORIAL OK"
MIRRORED = [
    "keras_tutorial.py",
    "custom_training.py",
    "input.py",
    "keras_io_distributed_training.py",
    "save_and_load.py",
    "distributed_training_guide.py",
]
MULTI_WORKER = ["multi_worker_with_keras.py", "multi_worker_with_ctl.py"]


@pytest.fixture(scope="module")
def mirrored_job(tmp_path_factory) -> tuple[int, str]:
    """Every MirroredStrategy tutorial under one `phalanx run -n 2`; the chief's output."""
    out = tmp_path_factory.mktemp("tutorials-mirrored")
    # --preload keras: the tutorials import Keras, the script that runs them does not itself
    cmd = [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", "--preload", "keras", str(RUN_PROGRAMS)]
    env = {**ENV, **programs_job_env([[TUTORIALS / name] for name in MIRRORED])}
    res = run_job(cmd, timeout=240 * len(MIRRORED), cwd=out, env=env)
    return res.returncode, res.logs() if res.returncode != 0 else res.output


@pytest.fixture(scope="module")
def multi_worker_job(tmp_path_factory) -> list[tuple[int, str]]:
    """Both MultiWorkerMirroredStrategy tutorials on one pair of TF_CONFIG workers; their outputs."""
    out = tmp_path_factory.mktemp("tutorials-multi-worker")
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    cmd = [sys.executable, str(RUN_PROGRAMS)]
    env = {**ENV, **programs_job_env([[TUTORIALS / name] for name in MULTI_WORKER])}
    results = run_jobs(
        [(cmd, {**env, **tf_config(workers, i)}) for i in range(2)], timeout=240 * len(MULTI_WORKER), cwd=out
    )
    return [(r.returncode, r.output) for r in results]


def _mirrored(job: tuple[int, str], name: str) -> None:
    assert OK in program_output(*job, MIRRORED.index(name), len(MIRRORED), name), name


def _multi_worker(job: list[tuple[int, str]], name: str) -> None:
    for rank, (code, output) in enumerate(job):
        index, label = MULTI_WORKER.index(name), f"{name} on worker {rank}"
        assert OK in program_output(code, output, index, len(MULTI_WORKER), label), (name, rank)


def test_keras(mirrored_job):
    _mirrored(mirrored_job, "keras_tutorial.py")


def test_multi_worker_with_keras(multi_worker_job):
    _multi_worker(multi_worker_job, "multi_worker_with_keras.py")


# The custom loop computes its loss from the logits, as TF does (see note 6 in the tutorial): with
# Keras 3's torch BinaryCrossentropy on the sigmoid's probabilities it learned in some runs only.
def test_parameter_server_training(tmp_path):
    pytest.importorskip("grpc")
    pytest.importorskip("cloudpickle")
    res = run_job([sys.executable, str(TUTORIALS / "parameter_server_training.py")], timeout=240, cwd=tmp_path, env=ENV)
    assert res.returncode == 0, res.logs()[-8000:]
    assert OK in res.output
    # The servers run in the chief's process: a successful run ends without gRPC's threads failing
    # at exit and without the coordinator losing its workers to that exit.
    assert "Traceback" not in res.output and "lost worker" not in res.output, res.output[-8000:]


def test_custom_training(mirrored_job):
    _mirrored(mirrored_job, "custom_training.py")


def test_input(mirrored_job):
    _mirrored(mirrored_job, "input.py")


def test_keras_io_distributed_training(mirrored_job):
    _mirrored(mirrored_job, "keras_io_distributed_training.py")


def test_multi_worker_with_ctl(multi_worker_job):
    _multi_worker(multi_worker_job, "multi_worker_with_ctl.py")


def test_save_and_load(mirrored_job):
    _mirrored(mirrored_job, "save_and_load.py")


def test_distributed_training_guide(mirrored_job):
    _mirrored(mirrored_job, "distributed_training_guide.py")
