"""GPU collective paths, run by tests/test_gpu.py (and on CPU replicas by tests/test_gpu_paths_on_cpu.py).

Usage: ``python gpu_job.py MODE OUT_DIR``, MODE one of:

* ``nccl1``: one process with PHALANX_SINGLE_REPLICA_COLLECTIVES=1: MirroredStrategy,
  CentralStorageStrategy and FullyShardedStrategy on the GPU build their NCCL group at world
  size 1 and train like plain torch; CPU tensors and barriers go through the gloo group beside
  it (FullyShardedStrategy: FSDP2 on torch's default group, ``cpu:gloo,cuda:nccl``).
* ``shared``: under ``phalanx run -n 2``: two replica processes on one GPU
  (MultiWorkerMirroredStrategy with RING: gloo reduces the CUDA buckets through the host); the
  training equals one device on the global batch; a replica that changes its weights is named
  one step late (the guard is read without stalling the GPU); a checkpoint is written from the GPU.

Each writes ``OUT_DIR/<mode>_<rank>.json`` with what the tests check. Without CUDA the same
code runs on CPU replicas, so the script itself is tested on every machine.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import phalanx as px

MODE, OUT = sys.argv[1], sys.argv[2]
# PHALANX_GPU_JOB_DEVICE=cpu: CPU replicas even where a GPU exists (the CPU twins of the GPU tests).
CUDA = torch.cuda.is_available() and os.environ.get("PHALANX_GPU_JOB_DEVICE") != "cpu"
DEVICE = "cuda" if CUDA else "cpu"
GLOBAL_BATCH = 32
STEPS = 6


def data():
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)) for _ in range(STEPS)
    ]


def layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


INITIAL = layers().state_dict()  # on the CPU, before any strategy


def plain_torch() -> list[torch.Tensor]:
    """The reference: one device, the whole global batch, SGD with momentum."""
    model = layers().to(DEVICE)
    model.load_state_dict(INITIAL)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in data():
        loss = ((model(x.to(DEVICE)) - y.to(DEVICE)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def train(strategy, *, diverge_at: int | None = None) -> tuple[torch.nn.Module, list[float], str | None]:
    """Trains under ``strategy``; returns the model, the losses and the error raised, if any."""
    with strategy.scope():
        model = layers()
        model.load_state_dict(INITIAL)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank = strategy.extended.process_index

    def step(x, y):
        per_example = ((model(x) - y) ** 2).mean(dim=1)
        loss = px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    losses, error = [], None
    dataset = strategy.experimental_distribute_dataset(data())
    try:
        for i, (x, y) in enumerate(dataset):
            if diverge_at is not None and i == diverge_at:
                if rank == 1:
                    with torch.no_grad():
                        next(model.parameters()).add_(1.0)  # replica 1 alone: silently different weights
                strategy.extended.mark_parameters_changed()  # the next all-reduce fingerprints them
            loss = strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)
            losses.append(float(loss))
        strategy.extended.check_consistency()
    except px.errors.ReplicaDivergenceError as e:
        error = f"{type(e).__name__} at step {i}: {e}"
    return model, losses, error


def write(name: str, result: dict) -> None:
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(result, f)


def nccl1() -> None:
    reference = plain_torch()
    result: dict = {"device": DEVICE}
    for kind in ("mirrored", "central_storage", "fully_sharded"):
        devices = [f"{'gpu' if CUDA else 'cpu'}:0"]
        strategy = {
            "mirrored": px.MirroredStrategy,
            "central_storage": px.CentralStorageStrategy,
            "fully_sharded": lambda d: px.FullyShardedStrategy(d, min_params_to_shard=64),
        }[kind](devices)
        comm = strategy.extended.communicator
        model, losses, error = train(strategy)
        # FullyShardedStrategy's parameters are DTensors (sharded over the one rank): whole tensors.
        params = [getattr(p, "full_tensor", p.detach)().detach().cpu() for p in model.parameters()]
        sharded = all(hasattr(p, "full_tensor") for p in model.parameters())
        cpu_sum = strategy.reduce("SUM", strategy.run(lambda: torch.ones(2)), axis=None)  # the gloo group
        gpu_sum = strategy.reduce("SUM", strategy.run(lambda: torch.ones(2, device=DEVICE)), axis=None)
        strategy.extended.barrier()
        result[kind] = {
            "communicator": type(comm).__name__,
            "backend": getattr(comm, "backend", None),
            "world_size": comm.world_size,
            "param_device": str(next(model.parameters()).device),
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(params, reference)),
            "losses": losses,
            "error": error,
            "guard_checks": strategy.extended.consistency_checks,
            "cpu_sum": cpu_sum.tolist(),
            "gpu_sum": gpu_sum.cpu().tolist(),
            "sharded": sharded,
        }
        strategy.close()
    write("nccl1_0.json", result)


def shared() -> None:
    options = px.CommunicationOptions(implementation=px.CommunicationImplementation.RING)
    strategy = px.MultiWorkerMirroredStrategy(communication_options=options)
    rank = strategy.extended.process_index
    reference = plain_torch()
    model, losses, error = train(strategy)
    params = [p.detach().cpu() for p in model.parameters()]
    ckpt = px.checkpoint.Checkpoint(model=model)
    path = ckpt.save(os.path.join(OUT, "ckpt", "gpu"))
    result = {
        "device": DEVICE,
        "param_device": str(next(model.parameters()).device),
        "backend": getattr(strategy.extended.communicator, "backend", None),
        "world_size": strategy.num_replicas_in_sync,
        "max_diff": max(float((a - b).abs().max()) for a, b in zip(params, reference)),
        "losses": losses,
        "error": error,
        "checkpoint": path,
        "params": [p.tolist() for p in params],
    }
    # A replica that changes its weights between steps: every replica names it, one step late at most.
    _, _, divergence = train(strategy, diverge_at=2)
    result["divergence"] = divergence
    write(f"shared_{rank}.json", result)


{"nccl1": nccl1, "shared": shared}[MODE]()
