"""A strategy in a process whose default process group someone else made (Ray Train, a program).

Ray Train makes torch's default group at ``MASTER_ADDR:MASTER_PORT`` before it calls the user's
function; a strategy made there used to listen on that port again (``ClusterSpecError: ... port
... is taken by another program``). These run without Ray, as 2 real processes that make the
group first; tests/test_ray_train.py runs the same under Ray itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import free_ports, run_jobs

SCRIPT = Path(__file__).parent / "scripts" / "joined_group.py"


def _run(tmp_path: Path, backend: str):
    (port,) = free_ports(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "KERAS_BACKEND": "torch"}
    jobs = [([sys.executable, str(SCRIPT), backend], {**env, "RANK": str(r)}) for r in range(2)]
    return run_jobs(jobs, timeout=90, cwd=tmp_path)


def test_a_strategy_joins_the_gloo_group_the_program_made_at_the_job_address(tmp_path):
    results = _run(tmp_path, "gloo")
    for r in results:
        assert r.returncode == 0, r.logs()
    assert [("sum 3" in r.output) for r in results] == [True, True], [r.output for r in results]


def test_a_default_group_on_a_backend_no_strategy_can_use_is_a_typed_error_naming_it(tmp_path):
    pytest.importorskip("torch.testing._internal.distributed.fake_pg", reason="this torch has no fake backend")
    results = _run(tmp_path, "fake")
    for r in results:
        assert r.returncode == 3, r.logs()
        assert "ClusterSpecError" in r.output and "backend='fake'" in r.output, r.output
