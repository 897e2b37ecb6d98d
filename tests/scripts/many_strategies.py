"""Several multi-replica strategies in one program, as TF's tutorials create them.

Usage: many_strategies.py OUT_DIR. Each strategy trains one step; after each, the replicas'
parameters are gathered and must be identical. Replica 0 writes ``OUT_DIR/done`` at the end.
"""

import gc
import os
import sys
from pathlib import Path

import torch

import phalanx as px

out = Path(sys.argv[1])
DEVICES = ["cpu:0", "cpu:1"]


def train_one_step(strategy, tag: str) -> None:
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = strategy.extended.process_index
    x = torch.arange(8.0).reshape(2, 4) + rank  # different data per replica: gradients must be summed

    def step():
        loss = px.nn.compute_average_loss(model(x).squeeze(1) ** 2, global_batch_size=4)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    strategy.run(step)
    # In a run of its own: CentralStorage's update is visible to every replica from the next run.
    params = strategy.gather(
        strategy.run(lambda: torch.cat([p.detach().flatten() for p in model.parameters()])[None]), axis=0
    )
    assert params.shape[0] == 2 and torch.equal(params[0], params[1]), (tag, params)
    print(
        f"{tag}: trained one step on replica {rank} of {strategy.num_replicas_in_sync}, pid {os.getpid()}", flush=True
    )


first = px.MirroredStrategy(DEVICES)
train_one_step(first, "mirrored #1")
second = px.MirroredStrategy(DEVICES)  # the first one is still alive
train_one_step(second, "mirrored #2")
train_one_step(first, "mirrored #1 again")  # alive together, one scope at a time
first.close()
central = px.CentralStorageStrategy(DEVICES)
train_one_step(central, "central storage")
del second
gc.collect()
train_one_step(px.MirroredStrategy(DEVICES), "mirrored #3")
if central.extended.process_index == 0:
    (out / "done").write_text("ok")
