"""The property that proves a synchronous strategy correct.

K steps on N replicas with global batch B give the same parameters as K steps on one device with
batch B (to float tolerance), and all replicas hold bit-identical parameters.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import jobs_on_first_use

SCRIPT = Path(__file__).parent / "scripts" / "equivalence.py"


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _load_script():
    spec = importlib.util.spec_from_file_location("_equivalence_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def references():
    """Plain PyTorch on one device: computed here, it needs no process of its own (fork_rng: it
    seeds the global generator, which the tests after it must not see). Module scope also puts it
    before any test's hygiene snapshot: Adam's first step sets TORCHINDUCTOR_CACHE_DIR in
    os.environ once per process."""
    script = _load_script()
    with torch.random.fork_rng(devices=[]):
        return {opt: {k: v.detach().clone() for k, v in script.reference(opt).state_dict().items()} for opt in OPTS}


OPTS = ["sgd", "adam"]
KINDS = ["mirrored", "central"]
CROSS_DEVICE_OPS_CASES = [("one", 3), ("hier", 2), ("hier", 4), ("packs", 2)]


def _variants(n: int) -> list[str]:
    """Every case on ``n`` replicas: one job runs them all, one after the other."""
    return [f"{kind},{opt}" for kind in KINDS for opt in OPTS if n in (2, 3)] + [
        f"mirrored,sgd,{ops}" for ops, m in CROSS_DEVICE_OPS_CASES if m == n
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{n: folder of n-replica results}, each world size's job started on first use."""

    def command(n: int, out: Path) -> list[str]:
        return [sys.executable, str(SCRIPT), str(out), "--variants", str(n), *_variants(n)]

    return jobs_on_first_use(tmp_path_factory, "x", command, timeout=300)


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    """OneDeviceStrategy needs no replica process: the script's run, here (fork_rng: it seeds the
    global generator)."""
    out = tmp_path_factory.mktemp("one-device")
    script = _load_script()
    with torch.random.fork_rng(devices=[]):
        for opt in OPTS:
            folder = out / f"one_device,{opt}"
            folder.mkdir()
            script.run(str(folder), opt, "one_device", 1).close()
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("kind", KINDS)
def test_synchronous_strategy_matches_one_device(runs, references, kind, n, opt):
    folder = runs(n) / f"{kind},{opt}"
    replicas = [_load(folder / f"params_{r}.pt") for r in range(n)]
    diff = _max_diff(replicas[0], references[opt])
    print(f"\n{kind} x{n}, {opt}: max |param - one-device param| = {diff:.3g}")
    assert diff < 1e-5
    for other in replicas[1:]:  # mirrored: kept identical; central: one shared copy
        assert all(torch.equal(replicas[0][k], other[k]) for k in replicas[0]), "replicas diverged"


@pytest.mark.parametrize("opt", OPTS)
def test_one_device_matches_plain_torch(one_device_run, references, opt):
    assert _max_diff(_load(one_device_run / f"one_device,{opt}" / "params_0.pt"), references[opt]) < 1e-6


@pytest.mark.parametrize("ops,n", CROSS_DEVICE_OPS_CASES)
def test_cross_device_ops_algorithms_match_one_device(runs, references, ops, n):
    folder = runs(n) / f"mirrored,sgd,{ops}"
    replicas = [_load(folder / f"params_{r}.pt") for r in range(n)]
    diff = _max_diff(replicas[0], references["sgd"])
    print(f"\n{ops} x{n}: max diff {diff:.3g}")
    assert diff < 1e-5
    for other in replicas[1:]:
        assert all(torch.equal(replicas[0][k], other[k]) for k in replicas[0]), "replicas diverged"
