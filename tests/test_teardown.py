"""A launched job's processes end without the interpreter's final collections over torch's heap.

Those collections took 1.2 CPU-seconds per process with Keras (0.6 with torch alone), and a
self-launched replica 0 waits for the other replicas' teardown before its own: most of the 3 s a
newcomer saw between the last epoch and the prompt. What is garbage at exit is still finalised.
"""

from __future__ import annotations

import sys

from conftest import run_job

JOB = """
import atexit, gc, os
def report():  # registered before the strategy: runs after phalanx's exit handlers (LIFO)
    print(f"FROZEN {os.environ.get('PHALANX_RANK', '0')} {gc.get_freeze_count() > 0}", flush=True)
atexit.register(report)
import torch, phalanx as px

class Cycle:  # garbage in a reference cycle, with a finaliser: collected, never frozen
    def __init__(self, path):
        self.me, self.path = self, path
    def __del__(self):
        with open(self.path, "w") as f:
            f.write("finalised")

strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1)), axis=None)
Cycle(f"finalised_{px.process_index()}.txt")
print("total", float(total), flush=True)
"""


def test_a_self_launched_job_freezes_what_is_left_at_exit_and_finalises_its_garbage(tmp_path, script):
    # fresh: a replica forked from the suite's fork server has a frozen heap already
    result = run_job([sys.executable, str(script(JOB))], timeout=120, cwd=tmp_path, fresh=True)
    logs = result.logs()
    assert result.returncode == 0 and "total 2.0" in result.output, logs
    assert "FROZEN 0 True" in result.output, logs  # replica 0, on the terminal
    assert "FROZEN 1 True" in logs, logs  # replica 1, in its log
    for rank in (0, 1):
        assert (tmp_path / f"finalised_{rank}.txt").read_text() == "finalised", logs
