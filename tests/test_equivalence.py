"""The property that proves a synchronous strategy correct.

K steps on N replicas with global batch B give the same parameters as K steps on one device with
batch B (to float tolerance), and all replicas hold bit-identical parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import run_job

SCRIPT = Path(__file__).parent / "scripts" / "equivalence.py"


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    refs = {}
    for opt in ("sgd", "adam"):
        out = tmp_path_factory.mktemp(f"ref-{opt}")
        res = run_job([sys.executable, str(SCRIPT), str(out), opt, "reference"], timeout=60, cwd=out)
        assert res.returncode == 0, res.logs()
        refs[opt] = _load(out / "params_0.pt")
    return refs


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("kind", ["mirrored", "central"])
def test_synchronous_strategy_matches_one_device(tmp_path, references, kind, n, opt):
    res = run_job([sys.executable, str(SCRIPT), str(tmp_path), opt, kind, str(n)], timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.logs()
    replicas = [_load(tmp_path / f"params_{r}.pt") for r in range(n)]
    diff = _max_diff(replicas[0], references[opt])
    print(f"\n{kind} x{n}, {opt}: max |param - one-device param| = {diff:.3g}")
    assert diff < 1e-5
    for other in replicas[1:]:  # mirrored: kept identical; central: one shared copy
        assert all(torch.equal(replicas[0][k], other[k]) for k in replicas[0]), "replicas diverged"


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_one_device_matches_plain_torch(tmp_path, references, opt):
    res = run_job([sys.executable, str(SCRIPT), str(tmp_path), opt, "one_device", "1"], timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.logs()
    assert _max_diff(_load(tmp_path / "params_0.pt"), references[opt]) < 1e-6


@pytest.mark.parametrize("ops,n", [("one", 3), ("hier", 2), ("hier", 4), ("packs", 2)])
def test_cross_device_ops_algorithms_match_one_device(tmp_path, references, ops, n):
    res = run_job(
        [sys.executable, str(SCRIPT), str(tmp_path), "sgd", "mirrored", str(n)],
        timeout=120,
        cwd=tmp_path,
        env={"EQUIV_CROSS_DEVICE_OPS": ops},
    )
    assert res.returncode == 0, res.logs()
    replicas = [_load(tmp_path / f"params_{r}.pt") for r in range(n)]
    diff = _max_diff(replicas[0], references["sgd"])
    print(f"\n{ops} x{n}: max diff {diff:.3g}")
    assert diff < 1e-5
    for other in replicas[1:]:
        assert all(torch.equal(replicas[0][k], other[k]) for k in replicas[0]), "replicas diverged"
