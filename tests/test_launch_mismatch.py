"""A launcher's processes and the strategy that disagree are told, once, with how to fix it.

TF does what phalanx does here: a OneDeviceStrategy program under ``phalanx run -n 2`` trains two
independent copies, and ``MultiWorkerMirroredStrategy()`` with no cluster trains one replica. Both
run to the end silently, and a newcomer loses an hour wondering why nothing got faster.
"""

from __future__ import annotations

import sys

from conftest import run_job

TRAIN = """
import torch, phalanx as px
{before}
strategy = {strategy}
with strategy.scope():
    model = torch.nn.Linear(4, 1)
total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1)), axis=None)
print("replicas", strategy.num_replicas_in_sync, "total", float(total), flush=True)
"""
RUN = [sys.executable, "-m", "phalanx.cli", "run", "-n", "2"]


def test_one_device_strategy_under_phalanx_run_is_told_once_that_it_trains_copies(tmp_path, script):
    path = script(TRAIN.format(before="", strategy='px.OneDeviceStrategy("cpu")'))
    result = run_job([*RUN, str(path)], timeout=120, cwd=tmp_path)
    assert result.returncode == 0 and "replicas 1 total 1.0" in result.output, result.logs()
    notices = [line for line in result.output.splitlines() if "OneDeviceStrategy" in line]
    assert len(notices) == 1, result.output  # replica 0's, on the terminal (replica 1's is in its log)
    notice = notices[0]
    assert notice.startswith("phalanx: ") and "2 processes" in notice and "2 independent copies" in notice, notice
    assert "MultiWorkerMirroredStrategy()" in notice and "python " in notice, notice  # how to fix it, both ways


def test_multi_worker_mirrored_strategy_alone_is_told_once_that_it_trains_one_replica(tmp_path, script):
    # A OneDeviceStrategy first: alone, as it should be, it says nothing.
    path = script(TRAIN.format(before='px.OneDeviceStrategy("cpu")', strategy="px.MultiWorkerMirroredStrategy()"))
    result = run_job([sys.executable, str(path)], timeout=120, cwd=tmp_path)
    assert result.returncode == 0 and "replicas 1 total 1.0" in result.output, result.logs()
    notices = [line for line in result.output.splitlines() if line.startswith("phalanx: ")]
    assert len(notices) == 1 and "MultiWorkerMirroredStrategy" in notices[0], result.output
    notice = notices[0]
    assert "no cluster" in notice and "one replica" in notice, notice
    assert "phalanx run -n N" in notice and "TF_CONFIG" in notice, notice


def test_no_notice_where_launcher_and_strategy_agree(tmp_path, script):
    path = script(TRAIN.format(before="", strategy="px.MultiWorkerMirroredStrategy()"))
    result = run_job([*RUN, str(path)], timeout=120, cwd=tmp_path)
    assert result.returncode == 0 and "replicas 2 total 2.0" in result.output, result.logs()
    assert "independent copies" not in result.logs() and "no cluster" not in result.logs(), result.logs()
