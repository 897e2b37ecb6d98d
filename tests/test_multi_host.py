"""Two hosts as Linux network namespaces joined by a veth pair; TF_CONFIG names their addresses.

Skipped, with the reason, where namespaces cannot be created (not root, no iproute2).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from conftest import run_jobs, tf_config

EQUIV = Path(__file__).parent / "scripts" / "equivalence.py"
FAULTS = Path(__file__).parent / "scripts" / "faults.py"
SHARDED = Path(__file__).parent / "scripts" / "sharded.py"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = uuid.uuid4().hex[:6]
    names = [f"px{tag}a", f"px{tag}b"]
    addrs = ["10.231.7.1", "10.231.7.2"]
    created = []
    try:
        for n in names:
            r = _ip("netns", "add", n)
            if r.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {r.stderr.strip()}")
            created.append(n)
        veth = [f"v{tag}a", f"v{tag}b"]
        steps = [("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])]
        for n, v, a in zip(names, veth, addrs):
            steps += [
                ("link", "set", v, "netns", n),
                ("-n", n, "addr", "add", f"{a}/24", "dev", v),
                ("-n", n, "link", "set", v, "up"),
                ("-n", n, "link", "set", "lo", "up"),
            ]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot wire the namespaces ({' '.join(step)}): {r.stderr.strip()}")
        yield list(zip(names, addrs))
    finally:
        for n in created:
            _ip("netns", "delete", n)


@pytest.fixture(scope="module")
def sgd_reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch on one device, computed here: bitwise what ``equivalence.py OUT sgd reference``
    saves, without a process of its own (as tests/test_multi_worker.py does). At module set-up,
    before any test's hygiene snapshot: the first optimizer step sets TORCHINDUCTOR_CACHE_DIR in
    os.environ once per process. fork_rng: the reference seeds the global generator."""
    spec = importlib.util.spec_from_file_location("_equivalence_script", EQUIV)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with torch.random.fork_rng(devices=[]):
        return {k: v.detach().clone() for k, v in script.reference("sgd").state_dict().items()}


def test_two_hosts_training_matches_one_device(tmp_path, two_hosts, sgd_reference):
    workers = [f"{addr}:29611" for _, addr in two_hosts]
    jobs = [
        (
            ["ip", "netns", "exec", ns, sys.executable, str(EQUIV), str(tmp_path), "sgd", "mwms", "0"],
            tf_config(workers, i),
        )
        for i, (ns, _) in enumerate(two_hosts)
    ]
    results = run_jobs(jobs, timeout=120, cwd=tmp_path)
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    ref = sgd_reference
    a, b = (torch.load(tmp_path / f"params_{r}.pt", weights_only=True) for r in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    diff = max(float((a[k] - ref[k]).abs().max()) for k in a)
    print(f"\nMWMS across 2 network namespaces: max diff {diff:.3g}")
    assert diff < 1e-5


def test_two_hosts_listeners_use_the_host_address(tmp_path, two_hosts):
    import json

    workers = [f"{addr}:29612" for _, addr in two_hosts]
    jobs = [
        (["ip", "netns", "exec", ns, sys.executable, str(FAULTS), str(tmp_path), "uneven"], tf_config(workers, i))
        for i, (ns, _) in enumerate(two_hosts)
    ]
    results = run_jobs(jobs, timeout=90, cwd=tmp_path)
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    for i, (_, addr) in enumerate(two_hosts):
        rec = json.loads((tmp_path / f"fault_{i}.json").read_text())
        mine = [line.split()[3] for line in rec["ss"].splitlines() if f"pid={rec['pid']}," in line]
        assert mine and all(local.startswith(f"{addr}:") for local in mine), (addr, mine)


@pytest.fixture(scope="module")
def adam_reference() -> dict[str, torch.Tensor]:
    """``sharded.py``'s plain-PyTorch reference (Adam), at module set-up as ``sgd_reference``."""
    spec = importlib.util.spec_from_file_location("_sharded_script", SHARDED)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with torch.random.fork_rng(devices=[]):
        return {k: v.detach().clone() for k, v in script.reference("adam").state_dict().items()}


def test_two_hosts_fully_sharded_training_matches_one_device(tmp_path, two_hosts, adam_reference):
    """FullyShardedStrategy from TF_CONFIG across two hosts: torch's default group (FSDP2's) is
    built by phalanx with gloo on each host's own interface (not the one its name resolves to,
    which another host cannot reach here), and the training equals one device."""
    reference = adam_reference
    workers = [f"{addr}:29613" for _, addr in two_hosts]
    jobs = [
        (
            ["ip", "netns", "exec", ns, sys.executable, str(SHARDED), str(tmp_path), "env", "sharded"],
            tf_config(workers, i),
        )
        for i, (ns, _) in enumerate(two_hosts)
    ]
    results = run_jobs(jobs, timeout=180, cwd=tmp_path)
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    got = torch.load(tmp_path / "params.pt", weights_only=True)
    assert max(float((got[k] - reference[k]).abs().max()) for k in reference) < 5e-5
