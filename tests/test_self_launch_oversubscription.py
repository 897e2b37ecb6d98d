"""``python train.py`` with more CPU replicas than cores warns once, as ``phalanx run -n N`` does.

The replicas still train correctly; they share the cores and each step waits for the slowest.
The job pins itself to one core (its CPU affinity), so two replicas are already too many, on any
machine.
"""

from __future__ import annotations

import os
import sys

import pytest

from conftest import run_job

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")

JOB = """
import os, sys
import phalanx as px

if sys.argv[1] == "one-core":
    os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
strategy = {make}
strategy.close()
again = {make}  # the program's second strategy runs on the replicas started for the first
print(f"replica {{again.extended.process_index}} of {{again.num_replicas_in_sync}} ready", flush=True)
"""

MAKERS = {
    "MirroredStrategy": 'px.MirroredStrategy(["cpu:0", "cpu:1"])',
    "CentralStorageStrategy": 'px.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])',
}


@pytest.mark.parametrize("strategy", sorted(MAKERS))
def test_more_cpu_replicas_than_cores_warns_once(tmp_path, script, strategy):
    result = run_job(
        [sys.executable, str(script(JOB.format(make=MAKERS[strategy]))), "one-core"],
        timeout=180,
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.logs()
    expected = f"phalanx: warning: {strategy} starts 2 CPU replicas on 1 core(s); they share cores"
    assert result.output.count(expected) == 1, result.output
    assert "slower than with 1 replica(s)." in result.output, result.output
    assert "replica 0 of 2 ready" in result.output
    assert result.output.index(expected) < result.output.index("phalanx: started replicas 1..1")
    assert "phalanx: warning" not in result.logs().replace(result.output, ""), result.logs()  # replica 1 is quiet


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_no_warning_within_the_cores(tmp_path, script):
    result = run_job(
        [sys.executable, str(script(JOB.format(make=MAKERS["MirroredStrategy"]))), "all-cores"],
        timeout=180,
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.logs()
    assert "replica 0 of 2 ready" in result.output and "phalanx: warning" not in result.output, result.output
