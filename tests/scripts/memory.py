"""Memory of a job with a 64 MB model under a strategy.

Usage: python memory.py OUT_DIR KIND[,KIND...] N      (KIND: central | mirrored)

Replica 0 sums the proportional set size (PSS: shared pages split between their users) of every
replica process's anonymous and shared memory before the model exists and after two SGD-with-momentum
steps, and writes both to OUT_DIR/memory_KIND.json. Several kinds run one after the other on the same N
processes, each with a fresh strategy; the model, its optimizer state and the strategy of one are released
before the next one's baseline (the 64 MB tensors are mmap'ed by the allocator: freeing them returns them
to the system, so no kind can reuse another's pages and look smaller than it is).

File-backed pages (the torch libraries' code and data, about 0.7 GiB for the job with torch 2.13 CPU
and 1.3 GiB with a CUDA build of 2.14) are left out: their PSS is split with every other process on
the machine that maps the same library files, so it moves by tens of MiB when another test's job
starts or ends between the two measurements (it cost 2.14 its 160 MiB bound in a full-suite run). A
copy of the parameters or optimizer state is never file-backed: it is heap (anonymous) or a
``/dev/shm`` segment (shared memory, as CentralStorage's variables), both still counted.
"""

import gc
import json
import os
import sys

import torch

import phalanx as px


def pss_kib(pid: int) -> int:
    """PSS of the process's anonymous and shared-memory pages (Linux >= 5.0 splits Pss this way)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith("Pss_")}
    return fields["Pss_Anon"] + fields["Pss_Shmem"]


def job_pss(strategy) -> int:
    pids = strategy.gather(strategy.run(lambda: torch.tensor([os.getpid()])), axis=0).tolist()
    return sum(pss_kib(p) for p in pids) * 1024


def warm_up(strategy):
    # The first optimizer and the first backward load code and thread pools (tens of MB per
    # process) that have nothing to do with the model; pay for them before the baseline.
    with strategy.scope():
        tiny = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(tiny.parameters(), lr=0.1, momentum=0.9)

    def tiny_step(x):
        opt.zero_grad(set_to_none=True)
        px.nn.compute_average_loss(tiny(x).squeeze(1)).backward()
        opt.step()

    for x in strategy.experimental_distribute_dataset([torch.ones(6, 4)] * 2):
        strategy.run(tiny_step, args=(x,))


def measure(out_dir, kind, n):
    devices = [f"cpu:{i}" for i in range(n)]
    strategy = px.CentralStorageStrategy(devices) if kind == "central" else px.MirroredStrategy(devices)
    rank = strategy.extended.process_index
    warm_up(strategy)
    before = job_pss(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x):
        loss = px.nn.compute_average_loss(model(x).pow(2).sum(1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    g = torch.Generator().manual_seed(0)  # the same global batches in every process
    for x in strategy.experimental_distribute_dataset([torch.randn(6, 4096, generator=g) for _ in range(2)]):
        strategy.run(step, args=(x,))
    optimizer.zero_grad(set_to_none=True)
    after = job_pss(strategy)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        with open(os.path.join(out_dir, f"memory_{kind}.json"), "w") as f:
            json.dump({"before": before, "after": after, "param_bytes": param_bytes, "replicas": n}, f)
    strategy.close()


if __name__ == "__main__":
    for kind in sys.argv[2].split(","):
        measure(sys.argv[1], kind, int(sys.argv[3]))
        gc.collect()  # the kind's model, optimizer state and strategy, before the next one's baseline
