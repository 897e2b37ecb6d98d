"""The two seed examples (examples/keras_*.py) run under every strategy, only ``--strategy`` changed:
OneDevice, Mirrored, CentralStorage and MultiWorkerMirrored here (2 CPU replicas or 2 TF_CONFIG
workers), ParameterServer on a real `phalanx run --ps 2 --workers 2` cluster.

A Keras process costs ~7 s of CPU to start, more than these examples' training: the synchronous
runs share two jobs (``scripts/run_programs.py`` runs each as ``python EXAMPLE --strategy S``
would, one after the other): one ``python`` job whose one-device runs come first on replica 0 and
whose Mirrored and CentralStorage runs self-launch the second replica once, and one pair of
TF_CONFIG workers. Each example comes first (in a fresh process) in one of them. Each test checks
its own run's output on the chief and on the other replica.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import RUN_PROGRAMS, free_ports, program_output, programs_job_env, run_job, run_jobs, tf_config

EXAMPLES = Path(__file__).parent.parent / "examples"
# One thread per process: on a small shared CI host, OpenMP pools of several processes (two
# "workers" on one host, or other jobs) fight over the cores and a step can take 10x longer.
ENV = {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
DONE = {"keras_mnist_mlp.py": "Time taken by normal training", "keras_toy.py": "Epoch 5/5"}
# (example, strategy) in the order the self-launched job runs them; one_device on replica 0 only.
SELF_LAUNCHED = [
    ("keras_mnist_mlp.py", "one_device"),
    ("keras_toy.py", "one_device"),
    ("keras_toy.py", "mirrored"),
    ("keras_mnist_mlp.py", "mirrored"),
    ("keras_mnist_mlp.py", "central_storage"),
    ("keras_toy.py", "central_storage"),
]
MULTI_WORKER = [("keras_toy.py", "multi_worker"), ("keras_mnist_mlp.py", "multi_worker")]


def _plan(runs: list[tuple[str, str]]) -> dict[str, str]:
    entries = [
        (["chief-only"] if strategy == "one_device" else []) + [EXAMPLES / example, "--strategy", strategy]
        for example, strategy in runs
    ]
    return programs_job_env(entries)


@pytest.fixture(scope="module")
def self_launched_job(tmp_path_factory) -> tuple[int, str, str]:
    """(exit code, the chief's output, replica 1's log) of the one-device, Mirrored and
    CentralStorage runs, on one process that self-launches one more."""
    out = tmp_path_factory.mktemp("examples-self-launched")
    cmd = [sys.executable, str(RUN_PROGRAMS)]
    res = run_job(cmd, timeout=150 * len(SELF_LAUNCHED), cwd=out, env={**ENV, **_plan(SELF_LAUNCHED)})
    other = "\n".join(p.read_text(errors="replace") for p in res.log_dir.rglob("replica_*.log"))
    return res.returncode, res.logs() if res.returncode != 0 else res.output, other


@pytest.fixture(scope="module")
def multi_worker_job(tmp_path_factory) -> tuple[int, str, str]:
    """(exit code, worker 0's output, worker 1's output) of the MultiWorkerMirrored runs."""
    out = tmp_path_factory.mktemp("examples-multi-worker")
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    cmd, env = [sys.executable, str(RUN_PROGRAMS)], {**ENV, **_plan(MULTI_WORKER)}
    results = run_jobs([(cmd, {**env, **tf_config(workers, i)}) for i in range(2)], timeout=300, cwd=out)
    code = next((r.returncode for r in results if r.returncode != 0), 0)
    return code, results[0].output, results[1].output


@pytest.mark.parametrize("strategy", ["one_device", "mirrored", "central_storage", "multi_worker"])
@pytest.mark.parametrize("example", sorted(DONE))
def test_seed_example_runs(request, example, strategy):
    runs = MULTI_WORKER if strategy == "multi_worker" else SELF_LAUNCHED
    code, chief_out, other_out = request.getfixturevalue(
        "multi_worker_job" if strategy == "multi_worker" else "self_launched_job"
    )
    index, name = runs.index((example, strategy)), f"{example} --strategy {strategy}"
    chief = program_output(code, chief_out, index, len(runs), name)
    if strategy != "one_device":
        other = program_output(code, other_out, index, len(runs), f"{name} (replica 1)")
    assert DONE[example] in chief
    if example == "keras_mnist_mlp.py":
        # The distributed model's progress bar appears on the chief only (the normal model, trained
        # on every process as in the notebook, prints everywhere).
        assert chief.count("Epoch 10/10") == 2
        if strategy != "one_device":
            assert other.count("Epoch 10/10") == 1
    else:
        assert "Total params: 193" in chief
        if strategy != "one_device":
            assert "Epoch 1/5" not in other


def test_toy_example_under_parameter_server_strategy(tmp_path):
    """The toy example's DataLoader is shipped to each worker, which runs fit's steps; the chief
    alone prints the summary and the progress bar, and every epoch's 10 steps are applied."""
    cmd = [
        sys.executable,
        "-m",
        "phalanx.cli",
        "run",
        "--ps",
        "2",
        "--workers",
        "2",
        str(EXAMPLES / "keras_toy.py"),
        "--strategy",
        "parameter_server",
    ]
    res = run_job(cmd, timeout=200, cwd=tmp_path, env=ENV)
    assert res.returncode == 0, res.logs()[-8000:]
    assert "Total params: 193" in res.output
    epochs = res.output.split("Epoch ")[1:]
    assert [e[:3] for e in epochs] == [f"{k}/5" for k in range(1, 6)], res.output[-3000:]
    # Keras's progress bar may print 10/10 twice (last batch, then the epoch's end): once or more.
    assert all("10/10" in e for e in epochs), res.output[-3000:]


def test_seed_mlp_under_parameter_server_strategy(tmp_path):
    """The notebook's MLP, only `--strategy parameter_server` changed, on a real cluster (gRPC):
    `phalanx run --ps 2 --workers 2`. fit's steps run asynchronously on the workers; the final
    epoch's loss is as low as the notebook's own one-device fit in the same script."""
    import re

    cmd = [
        sys.executable,
        "-m",
        "phalanx.cli",
        "run",
        "--ps",
        "2",
        "--workers",
        "2",
        str(EXAMPLES / "keras_mnist_mlp.py"),
        "--strategy",
        "parameter_server",
    ]
    res = run_job(cmd, timeout=200, cwd=tmp_path, env=ENV)
    assert res.returncode == 0, res.logs()[-8000:]
    assert DONE["keras_mnist_mlp.py"] in res.output
    text = re.sub(r"\x1b\[[0-9;]*m", "", res.output)
    distributed, normal = text.split("Time taken by distributed training")
    final = [float(re.findall(r"60/60.*? - loss: ([0-9.]+)", part)[-1]) for part in (distributed, normal)]
    print(f"\nseed MLP, final epoch loss: parameter servers {final[0]:.4f}, one device {final[1]:.4f}")
    assert final[0] < 1.5 * final[1] + 0.02
