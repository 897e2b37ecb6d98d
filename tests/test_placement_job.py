"""Packing in a real job: ``python train.py`` with MirroredStrategy on a crowded host (issue 33).

Started fresh, a self-launched job of two replicas spawns replica 1 from replica 0, so replica 1
is replica 0's child: what replica 0 does to its descendants (giving a process started while
packed its mask back) must not unpack its own peer. The policy's branches are in
test_placement.py, the communicator's side in test_shm_allreduce.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import run_job

JOB = """
import json, os, subprocess, sys, time
import psutil
import torch
import phalanx as px

strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
rank = strategy.extended.process_index
load = []
if rank == 0:
    # One session each, as a second job would be; each spins only while this replica lives.
    spin = [sys.executable, "-c", f"import os\\nwhile os.getppid() == {os.getpid()}: pass"]
    load = [subprocess.Popen(spin, start_new_session=True) for _ in range(2 * len(os.sched_getaffinity(0)))]
torch.manual_seed(0)
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 256), torch.randn(64, 1)


def step():
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


masks = []  # after each step: the masks of this replica's threads
try:
    for _ in range(int(sys.argv[2])):
        strategy.run(step)
        masks.append(sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}))
finally:
    for p in load:
        os.killpg(p.pid, 9)
        p.wait()
parent = psutil.Process().ppid()
json.dump({"pid": os.getpid(), "parent": parent, "masks": masks}, open(f"{sys.argv[1]}.{rank}", "w"))
strategy.close()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="packing needs two cores")
def test_a_self_launched_job_on_a_crowded_host_keeps_both_replicas_packed(tmp_path, script):
    path = script(JOB)
    out = tmp_path / "out"
    result = run_job([sys.executable, str(path), str(out), "400"], timeout=180, cwd=tmp_path, fresh=True)
    assert result.returncode == 0, result.logs()[-5000:]
    first, second = (json.loads((tmp_path / f"out.{rank}").read_text()) for rank in (0, 1))
    assert second["parent"] == first["pid"], (first["pid"], second["parent"])  # replica 1 is replica 0's child
    end = [r["masks"][-1] for r in (first, second)]
    assert end[0] == end[1] and len(end[0]) == 1 and len(end[0][0]) == 1, (
        f"at the last step, replica 0's threads had masks {end[0]} and replica 1's {end[1]}: "
        "not both on one core beside 4 busy processes"
    )
    # Once packed, a replica stays packed: the busy processes never leave.
    for rank, r in enumerate((first, second)):
        packed = [i for i, m in enumerate(r["masks"]) if m == end[0]]
        since = packed[0]
        assert all(m == end[0] for m in r["masks"][since:]), (rank, since, r["masks"][since:][:20])
