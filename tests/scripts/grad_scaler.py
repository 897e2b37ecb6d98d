"""float16 autocast with torch.amp.GradScaler under a strategy; replica 1 overflows at one step.

Usage: python grad_scaler.py OUT_DIR STRATEGY      (STRATEGY: mirrored | central)
Each replica writes scaler_{rank}.json: the scale after each step and whether the parameters moved.
keras_precision.py runs :func:`run` on its replica processes too (one job for both tests' runs).
"""

import faulthandler
import json
import os
import sys

import torch

if __name__ == "__main__":  # a hung job dumps its stacks (on the signal the test harness sends)
    from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

    faulthandler.register(stack_signal(), all_threads=True)

import phalanx as px  # noqa: E402

OVERFLOW_STEP, STEPS, GLOBAL_BATCH = 2, 5, 16


def main():
    run(sys.argv[1], sys.argv[2])


def run(out, kind):
    """The run of one strategy kind; returns this process's replica rank."""
    devices = ["cpu:0", "cpu:1"]
    strategy = px.MirroredStrategy(devices) if kind == "mirrored" else px.CentralStorageStrategy(devices)
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)) for _ in range(STEPS)
    ]
    step_no = [0]

    def train_step(x, y):
        replica = px.get_replica_context().replica_id_in_sync_group
        with torch.autocast("cpu", dtype=torch.float16):
            per_example = ((model(x).float() - y) ** 2).mean(1)
        loss = px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        if replica == 1 and step_no[0] == OVERFLOW_STEP:
            loss = loss * float("inf")  # only this replica's gradients overflow
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    record = []
    for x, y in strategy.experimental_distribute_dataset(batches):
        before = [p.detach().clone() for p in model.parameters()]
        strategy.run(train_step, args=(x, y))
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        record.append({"scale": float(scaler.get_scale()), "moved": moved})
        step_no[0] += 1
    rank = px.process_index()
    with open(os.path.join(out, f"scaler_{rank}.json"), "w") as f:
        json.dump({"steps": record, "params": [p.detach().flatten().tolist() for p in model.parameters()]}, f)
    strategy.close()
    return rank


if __name__ == "__main__":
    main()
