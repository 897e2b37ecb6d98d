"""A task waiting at rendezvous for a peer that never comes says so once, long before its timeout.

Without the notice a MultiWorkerMirrored worker started without its peer sat silent for the whole
rendezvous timeout (two minutes by default), which looks like a hang.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import free_ports, run_job, run_jobs, tf_config

JOB = """
import phalanx as px
strategy = px.MultiWorkerMirroredStrategy()
print("strategy ready", flush=True)
"""

NOTICE = re.compile(r"phalanx: waiting for (.+); giving up in (\d+) s \(PHALANX_RENDEZVOUS_TIMEOUT\)")


@pytest.mark.parametrize("index,missing", [(0, 1), (1, 0)])
def test_a_lone_worker_names_the_missing_peer_once_then_times_out(tmp_path, script, index, missing):
    """Worker 0 waits for worker 1 to publish; worker 1 waits for worker 0's store: both are named."""
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    result = run_job(
        [sys.executable, str(script(JOB))],
        timeout=120,
        cwd=tmp_path,
        env={**tf_config(workers, index), "PHALANX_RENDEZVOUS_TIMEOUT": "6", "PHALANX_RENDEZVOUS_NOTICE": "1"},
    )
    out = result.output
    assert result.returncode != 0 and "strategy ready" not in out, out
    notices = NOTICE.findall(out)
    assert len(notices) == 1, out
    who, left = notices[0]
    assert who == f"worker:{missing} (rank {missing}) at {workers[missing]}", out
    assert 0 < int(left) <= 5, out  # 6 s timeout, noticed after 1 s
    error = out.index("RendezvousTimeoutError: Timed out after 6.0s waiting for tasks: worker:")
    assert out.index("phalanx: waiting for") < error, out


def test_no_notice_when_every_peer_arrives_before_the_delay(tmp_path, script):
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    path = script(JOB)
    # 30 s: both tasks start together and meet within a few seconds even on a loaded machine.
    env = {"PHALANX_RENDEZVOUS_NOTICE": "30"}
    results = run_jobs(
        [([sys.executable, str(path)], {**tf_config(workers, i), **env}) for i in range(2)], timeout=120, cwd=tmp_path
    )
    for r in results:
        assert r.returncode == 0 and "strategy ready" in r.output, r.output
        assert "phalanx: waiting for" not in r.output, r.output


def test_a_chief_names_the_parameter_server_it_still_waits_for(tmp_path, script):
    chief, ps, worker = (f"127.0.0.1:{p}" for p in free_ports(3))
    config = {"cluster": {"chief": [chief], "ps": [ps], "worker": [worker]}, "task": {"type": "chief", "index": 0}}
    result = run_job(
        [sys.executable, str(script("import phalanx as px\npx.ParameterServerStrategy()\n"))],
        timeout=120,
        cwd=tmp_path,
        env={
            "TF_CONFIG": json.dumps(config),
            "PHALANX_CLUSTER_SECRET": "s" * 32,
            "PHALANX_RENDEZVOUS_TIMEOUT": "6",
            "PHALANX_RENDEZVOUS_NOTICE": "1",
        },
    )
    out = result.output
    assert result.returncode != 0, out
    assert NOTICE.findall(out) == [(f"ps:0 at {ps}", NOTICE.search(out).group(2))], out
    assert out.index("phalanx: waiting for") < out.index("RendezvousTimeoutError: Timed out after 6.0s"), out


# A self-launched job whose every process takes `slow` seconds to start (a fresh interpreter importing
# torch and Keras on a busy machine), and replica 1 `late` seconds more.
SLOW_START = """
import os, time
time.sleep({slow} + ({late} if os.environ.get("PHALANX_RANK") == "1" else 0))
import torch, phalanx as px
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1)), axis=None)
print("total", float(total), flush=True)
"""
ANY_NOTICE = re.compile(r"phalanx: (?:waiting for|\S+ \(rank \d+\) is still starting).*")


def test_no_notice_when_a_self_launched_replica_starts_as_slowly_as_replica_0(tmp_path, script):
    """Replica 1 starts only once replica 0 has reached its strategy, and takes as long as replica 0
    did to get there: a healthy job, which printed "giving up in 115 s" when that took over 5 s."""
    result = run_job(
        [sys.executable, str(script(SLOW_START.format(slow=3.0, late=0)))],
        timeout=120,
        cwd=tmp_path,
        env={"PHALANX_RENDEZVOUS_NOTICE": "1"},  # 1 s: replica 1 takes 3 s more than that to arrive
    )
    assert result.returncode == 0 and "total 2.0" in result.output, result.logs()
    assert not ANY_NOTICE.search(result.output), result.output


def test_a_self_launched_replica_that_is_really_late_is_named_once_and_the_job_still_succeeds(tmp_path, script):
    """Late against how long replica 0 took to start: named, once, with how long it has been starting."""
    result = run_job(
        [sys.executable, str(script(SLOW_START.format(slow=0.5, late=8.0)))],
        timeout=120,
        cwd=tmp_path,
        env={"PHALANX_RENDEZVOUS_NOTICE": "1"},
    )
    assert result.returncode == 0 and "total 2.0" in result.output, result.logs()
    notices = ANY_NOTICE.findall(result.output)
    assert len(notices) == 1, result.output
    line = ANY_NOTICE.search(result.output).group(0)
    assert line.startswith("phalanx: replica:1 (rank 1) is still starting: not here after"), line
    assert "giving up" not in line, line
