"""MultiWorkerMirroredStrategy: equivalence across workers, launched through TF_CONFIG and phalanx run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_ports, run_job, run_jobs, tf_config

SCRIPTS = Path(__file__).parent / "scripts"
EQUIV = SCRIPTS / "equivalence.py"


def _load_equivalence():
    spec = importlib.util.spec_from_file_location("_equivalence_script", EQUIV)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_REFERENCES: dict[str, dict[str, torch.Tensor]] = {}


@pytest.fixture(scope="module", autouse=True)
def _references():
    """Plain PyTorch on one device, per optimizer, computed here (no process of its own needed;
    bitwise what ``equivalence.py OUT OPT reference`` saves). At module set-up, before any test's
    hygiene snapshot: Adam's first step sets TORCHINDUCTOR_CACHE_DIR in os.environ once per
    process. fork_rng: the reference seeds the global generator."""
    script = _load_equivalence()
    with torch.random.fork_rng(devices=[]):
        for opt in ("sgd", "adam"):
            _REFERENCES[opt] = {k: v.detach().clone() for k, v in script.reference(opt).state_dict().items()}
    yield
    _REFERENCES.clear()


def _check_equivalence(out: Path, world: int, tmp_path: Path, opt: str = "sgd") -> float:
    ref = _REFERENCES[opt]
    replicas = [torch.load(out / f"params_{r}.pt", weights_only=True) for r in range(world)]
    diff = max(float((replicas[0][k] - ref[k]).abs().max()) for k in ref)
    for other in replicas[1:]:
        assert all(torch.equal(replicas[0][k], other[k]) for k in ref), "replicas diverged"
    assert diff < 1e-5
    return diff


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_two_workers_hand_written_tf_config(tmp_path, opt):
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    jobs = [([sys.executable, str(EQUIV), str(tmp_path), opt, "mwms", "0"], tf_config(workers, i)) for i in range(2)]
    results = run_jobs(jobs, timeout=120, cwd=tmp_path)
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    diff = _check_equivalence(tmp_path, 2, tmp_path, opt)
    print(f"\nMWMS 2 workers x 1 (TF_CONFIG), {opt}: max diff {diff:.3g}")


def test_two_workers_two_replicas_each_phalanx_run_with_tf_config(tmp_path):
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    jobs = [
        (
            [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(EQUIV), str(tmp_path), "sgd", "mwms", "0"],
            tf_config(workers, i),
        )
        for i in range(2)
    ]
    results = run_jobs(jobs, timeout=150, cwd=tmp_path)
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    diff = _check_equivalence(tmp_path, 4, tmp_path)
    print(f"\nMWMS 2 workers x 2 (phalanx run + TF_CONFIG): max diff {diff:.3g}")


def _two_nodes(tmp_path: Path, opt: str, env_for) -> list:
    """`phalanx run --nnodes 2 -n 2` of the equivalence script, one job per node, on one machine."""
    (port,) = free_ports(1)
    command = [sys.executable, "-m", "phalanx.cli", "run", "--nnodes", "2", "--master", f"127.0.0.1:{port}"]
    script = ["-n", "2", str(EQUIV), str(tmp_path), opt, "mwms", "0"]
    jobs = [([*command, "--node-rank", str(i), *script], env_for(i)) for i in range(2)]
    return run_jobs(jobs, timeout=150, cwd=tmp_path)


def test_two_nodes_phalanx_run_nnodes(tmp_path):
    results = _two_nodes(tmp_path, "sgd", lambda i: {})
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    diff = _check_equivalence(tmp_path, 4, tmp_path)
    print(f"\nMWMS 2 nodes x 2 (phalanx run --nnodes): max diff {diff:.3g}")


def test_phalanx_run_single_host_mwms(tmp_path):
    res = run_job(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(EQUIV), str(tmp_path), "adam", "mwms", "0"],
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.logs()
    _check_equivalence(tmp_path, 2, tmp_path, "adam")


def test_hierarchical_all_reduce_two_hosts_of_two(tmp_path):
    """Shared memory within each (simulated) host, gloo between hosts; same numbers as one device."""
    results = _two_nodes(tmp_path, "adam", lambda i: {"PHALANX_HOST_ID": f"host{i}"})
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    diff = _check_equivalence(tmp_path, 4, tmp_path, "adam")
    print(f"\nMWMS 2 hosts x 2, shared memory + gloo: max diff {diff:.3g}")


def test_plain_gloo_path_without_shared_memory(tmp_path):
    res = run_job(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(EQUIV), str(tmp_path), "sgd", "mwms", "0"],
        timeout=120,
        cwd=tmp_path,
        env={"PHALANX_SHM": "0"},
    )
    assert res.returncode == 0, res.logs()
    _check_equivalence(tmp_path, 2, tmp_path, "sgd")
