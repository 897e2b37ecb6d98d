"""Test-only: ``MirroredStrategy()`` in one task of a Slurm step (the ``SLURM_*`` variables set by the test)."""

import torch

import phalanx as px

strategy = px.MirroredStrategy()
total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1) * (px.process_index() + 1)), axis=None)
print(f"replicas {strategy.num_replicas_in_sync}, process {px.process_index()}, sum {float(total):g}", flush=True)
