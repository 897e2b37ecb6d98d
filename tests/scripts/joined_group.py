"""Test-only: a strategy made after the program (or its engine) made torch's default process group.

``python joined_group.py BACKEND`` runs as one of the job's processes (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` set, as Ray Train and torchrun set them): it makes the default
group on ``BACKEND`` at that address, as Ray Train does before ``train_loop_per_worker`` runs,
then ``MultiWorkerMirroredStrategy()`` and one all-reduce. ``fake`` is torch's test backend,
registered from Python: a backend no strategy can use.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import phalanx as px

backend = sys.argv[1]
if backend == "fake":
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
try:
    strategy = px.MultiWorkerMirroredStrategy()
    total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1) * (px.process_index() + 1)), axis=None)
    print(f"rank {rank}: sum {float(total):g}", flush=True)
except px.errors.ClusterSpecError as e:
    print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
    sys.exit(3)
