"""Replica program for the exit-semantics tests (tests/test_supervisor.py).

Usage: exits.py OUT_DIR MODE. Every replica writes ``pid_<rank>``; times are written as
``time.time()`` so the test can measure from the fault to the end of the job. No stack-dump
prelude here on purpose: the stack a lingering replica shows must come from phalanx itself.
"""

import os
import sys
import time
from pathlib import Path

import torch

import phalanx as px

out, mode = Path(sys.argv[1]), sys.argv[2]
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
rank = strategy.extended.process_index
(out / f"pid_{rank}").write_text(str(os.getpid()))


def collective() -> float:
    return float(strategy.reduce("SUM", strategy.run(lambda: torch.ones(())), axis=None))


def lingering_collective() -> float:
    return collective()  # replica 0 never joins this one


assert collective() == 2.0
if mode == "peer_raises":
    if rank == 1:
        (out / "t_fault").write_text(repr(time.time()))
        raise RuntimeError("boom on replica one")
    time.sleep(120)  # replica 0 busy elsewhere: it cannot notice by itself
elif mode == "zero_raises":
    if rank == 0:
        (out / "t_fault").write_text(repr(time.time()))
        raise ValueError("boom on replica zero")
    lingering_collective()
elif mode == "zero_sleeps":
    (out / f"ready_{rank}").write_text("1")
    if rank == 0:
        time.sleep(120)  # the test sends SIGINT to this process only
    lingering_collective()
elif mode == "peer_lingers":
    if rank == 1:
        lingering_collective()
    (out / "t_done").write_text(repr(time.time()))
elif mode == "sleep":
    (out / f"ready_{rank}").write_text("1")
    time.sleep(120)
print(f"replica {rank} done", flush=True)
