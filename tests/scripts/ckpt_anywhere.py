"""A Checkpoint made outside ``scope()`` under a self-launched MirroredStrategy (issue 13 item 7).

Usage: python ckpt_anywhere.py OUT_DIR   (starts its second replica itself)

As TF's multi-worker tutorials do, the model and optimizer are created in ``scope()`` and the
Checkpoint and its manager outside it. Every replica trains 3 steps and saves through the
manager (the chief writes, both wait); a second Checkpoint holds a Counter only (no variable
points at a strategy: the process's live strategy is used). Then each replica restores the
checkpoint into fresh objects made outside any scope and writes ``result_<rank>.json``.
Last, TF's multi-worker pattern (multi_worker_with_ctl's write_filepath): the chief saves to
``own_ckpts``, the other replica to a path of its own, ``workertemp_1/own_ckpts``; each path is
written by its replica.
"""

import faulthandler
import json
import os
import sys

import torch

from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

faulthandler.register(stack_signal(), all_threads=True)

import phalanx as px  # noqa: E402
from phalanx.checkpoint import Checkpoint, CheckpointManager, Counter, load_state, storage  # noqa: E402

out = sys.argv[1]
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
rank = strategy.extended.process_index
torch.manual_seed(0)
with strategy.scope():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

step = Counter()
ckpt = Checkpoint(model=model, optimizer=optimizer, step=step)  # outside scope(), as TF's tutorials
manager = CheckpointManager(ckpt, os.path.join(out, "ckpts"), max_to_keep=2)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]


def train_step(x, y):
    loss = px.nn.compute_average_loss(((model(x) - y) ** 2).sum(1), global_batch_size=8)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


for batch in strategy.experimental_distribute_dataset(data):
    strategy.run(train_step, args=batch)
    step.assign_add(1)
path = manager.save()
values_only = Checkpoint(step=step).write(os.path.join(out, "values_only"))

fresh = torch.nn.Linear(4, 2)
fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
fresh_step = Counter()
Checkpoint(model=fresh, optimizer=fresh_optimizer, step=fresh_step).restore(manager.latest_checkpoint)
result = {
    "rank": rank,
    "path": os.path.basename(path),
    "saved_by": storage.read_manifest(path)["saved_by"],
    "values_only_saved_by": storage.read_manifest(values_only)["saved_by"],
    "step": int(fresh_step),
    "restored_equal": all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())),
    "momentum_equal": all(
        torch.equal(optimizer.state[p]["momentum_buffer"], fresh_optimizer.state[q]["momentum_buffer"])
        for p, q in zip(model.parameters(), fresh.parameters())
    ),
    "weight_sum": float(model.weight.sum()),
}
own_dir = os.path.join(out, "own_ckpts") if rank == 0 else os.path.join(out, f"workertemp_{rank}", "own_ckpts")
own_path = CheckpointManager(Checkpoint(model=model, step=step), own_dir, max_to_keep=1).save()
own = load_state(own_path) if storage.is_complete(own_path) else None
result["own_path_written"] = own is not None and torch.equal(own["model"]["weight"], model.weight.detach())
with open(os.path.join(out, f"result_{rank}.json"), "w") as f:
    json.dump(result, f)
