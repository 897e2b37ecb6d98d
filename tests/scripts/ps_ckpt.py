"""Checkpoints of a real parameter-server cluster (gRPC, separate processes), saved with a table in 2
shards and restored into 3. Every task runs this script (``phalanx run --ps N --workers 1``):

    ps_ckpt.py OUT_DIR save      train 3 Adam steps, save OUT_DIR/ckpt; dump the next step's result
    ps_ckpt.py OUT_DIR restore   restore OUT_DIR/ckpt; dump what the servers hold, then take that step

Dumps (``torch.save`` of plain tensor dicts, read by tests/test_ps_cluster.py):
  next_step.pt       the model after the 4th step, in the saving cluster
  on_servers.pt      values and optimizer state read back from the restoring cluster's servers
  restored_next.pt   the model after the 4th step, in the restoring cluster
"""

import sys
from pathlib import Path

import torch

import phalanx as px
from phalanx.checkpoint import Checkpoint
from phalanx.coordinator import ClusterCoordinator
from phalanx.experimental.partitioners import FixedShardsPartitioner

OUT, MODE = Path(sys.argv[1]), sys.argv[2]
NUM_PS = 2 if MODE == "save" else 3
strategy = px.ParameterServerStrategy(variable_partitioner=FixedShardsPartitioner(NUM_PS))
# ------------------------------------------------------------------------------ chief only from here


class Embedder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(12, 4))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.table[ids])


def step(model, optimizer, ids, y):
    loss = torch.nn.functional.mse_loss(model(ids), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


g = torch.Generator().manual_seed(4)
batches = [(torch.randint(0, 12, (6,), generator=g), torch.randn(6, 1, generator=g)) for _ in range(4)]
coordinator = ClusterCoordinator(strategy)
torch.manual_seed(0 if MODE == "save" else 1)
with strategy.scope():
    model = Embedder()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
ext = strategy.extended
table = ext.remote_variable(model.table)
assert [v.shape[0] for v in table.variables] == ([6, 6] if MODE == "save" else [4, 4, 4]), table
ckpt = Checkpoint(model=model, optimizer=optimizer)

if MODE == "save":
    for ids, y in batches[:3]:
        coordinator.schedule(step, args=(model, optimizer, ids, y))
    coordinator.join()
    ckpt.write(str(OUT / "ckpt"))
else:
    ckpt.read(str(OUT / "ckpt"))
    specs = [ext.server_variables.spec_of(p) for p in model.parameters()]
    dump = {f"value/{i}": v for i, v in enumerate(ext.shard_io.read(specs))}
    for i, state in enumerate(ext.shard_io.read_optimizer_state(specs)):
        dump.update({f"state/{i}/{k}": v for k, v in state.items()})
    dump["chief_state_entries"] = torch.tensor(len(optimizer.state))
    torch.save(dump, OUT / "on_servers.pt")
coordinator.schedule(step, args=(model, optimizer, *batches[3]))
coordinator.join()
torch.save(model.state_dict(), OUT / ("next_step.pt" if MODE == "save" else "restored_next.pt"))
