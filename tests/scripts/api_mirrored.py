"""Exercises the Strategy API across real replicas; each replica writes what it saw as JSON.

Usage: python api_mirrored.py OUT_DIR N   (or under `phalanx run -n N api_mirrored.py OUT_DIR N`)
"""

import json
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the strategy matrix

import phalanx as px  # noqa: E402

import strategies  # noqa: E402

out_dir, n = sys.argv[1], int(sys.argv[2])
strategy = strategies.make("mirrored_cpu", n)
rank = strategy.extended.process_index
res = {"rank": rank, "num_replicas": strategy.num_replicas_in_sync, "chief": strategy.extended.should_checkpoint}
# Public process identity, outside any scope: from the live strategy.
res["identity"] = [px.process_index(), px.num_processes(), px.is_chief()]
px.barrier()

# run returns per-replica values; replica ids
ids = strategy.run(lambda: torch.tensor(px.get_replica_context().replica_id_in_sync_group))
res["run_type"] = type(ids).__name__
# TF: the values of this worker's replicas (all N here, one host), in replica order
res["local_ids"] = [int(i) for i in strategy.experimental_local_results(ids)]
res["local_id"] = int(strategy.experimental_local_results(ids)[rank])

# reduce: SUM / MEAN, axis None and axis=0 with uneven per-replica lengths
uneven = strategy.run(lambda: torch.arange(rank + 1, dtype=torch.float32) + 10 * rank)  # lengths 1, 2, 3...
res["sum_axis0"] = float(strategy.reduce("SUM", uneven, axis=0))
res["mean_axis0"] = float(strategy.reduce(px.ReduceOp.MEAN, uneven, axis=0))
scal = strategy.run(lambda: torch.tensor(float(rank + 1)))
res["sum_none"] = float(strategy.reduce("SUM", scal, axis=None))
res["mean_none"] = float(strategy.reduce("MEAN", scal, axis=None))
res["nested"] = {k: float(v) for k, v in strategy.reduce("SUM", {"a": scal, "b": scal}, axis=None).items()}
try:
    strategy.reduce("SUM", torch.tensor(1.0), axis=None)
    res["sum_plain"] = "no error"
except ValueError as e:  # TF raises ValueError (reduce_non_distributed_value)
    res["sum_plain"] = type(e).__name__

# gather with uneven lengths
res["gather"] = strategy.gather(uneven, axis=0).tolist()


# replica context collectives
def replica_fn():
    ctx = px.get_replica_context()
    s = ctx.all_reduce(px.ReduceOp.SUM, torch.tensor([1.0, float(ctx.replica_id_in_sync_group)]))
    m = ctx.all_reduce("MEAN", torch.tensor(float(ctx.replica_id_in_sync_group)))
    g = ctx.all_gather(torch.full((2,), float(ctx.replica_id_in_sync_group)), axis=0)
    merged = ctx.merge_call(lambda s_, v: s_.reduce("SUM", v, axis=None) * 100, args=(torch.tensor(1.0),))
    return s, m, g, merged


s, m, g, merged = strategy.run(replica_fn)
res["ctx_sum"] = strategy.experimental_local_results(s)[rank].tolist()
res["ctx_mean"] = float(strategy.experimental_local_results(m)[rank])
res["ctx_gather"] = strategy.experimental_local_results(g)[rank].tolist()
res["merge"] = float(strategy.experimental_local_results(merged)[rank])

# values from function
v = strategy.experimental_distribute_values_from_function(lambda ctx: torch.tensor(ctx.replica_id_in_sync_group * 7))
res["values_fn"] = int(strategy.experimental_local_results(v)[rank])

# distributed dataset: 5 rows then a final batch of 1 (smaller than N): nothing dropped, no hang
x = torch.arange(6, dtype=torch.float32).unsqueeze(1)
seen, totals = [], []
for batch in strategy.experimental_distribute_dataset([x[:5], x[5:6]]):
    local = strategy.experimental_local_results(batch)[rank]
    seen.append(local.squeeze(1).tolist())
    totals.append(float(strategy.reduce("SUM", strategy.run(lambda b: b.sum(), args=(batch,)), axis=None)))
res["dataset_slices"] = seen
res["dataset_totals"] = totals

# first batch smaller than the replica count
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    small = [batch.values[0].shape[0] for batch in strategy.experimental_distribute_dataset([x[:1]])]
res["small_batch"] = {"rows": small, "warnings": [str(w.message) for w in caught]}


# datasets from function with uneven lengths, one pipeline per replica (PER_REPLICA; TF's default
# is one per worker): replica r has r + 2 batches
def dataset_fn(ctx):
    return [torch.ones(2, 1) * ctx.input_pipeline_id for _ in range(ctx.input_pipeline_id + 2)]


steps = 0
per_replica = px.InputOptions(experimental_replication_mode=px.InputReplicationMode.PER_REPLICA)
for batch in strategy.distribute_datasets_from_function(dataset_fn, per_replica):
    steps += 1
    strategy.run(lambda b: b, args=(batch,))
res["fn_dataset_steps"] = steps
res["fn_dataset_ctx"] = [strategy.extended.num_processes, rank]

# BatchNorm buffers follow replica 0; parameters stay identical through training
with strategy.scope():
    torch.manual_seed(rank)  # different init per replica: the broadcast must fix it
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)


def train(b):
    loss = px.nn.compute_average_loss(model(b).pow(2).sum(1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


# Different data per replica: one pipeline per process (the same global batches are what
# experimental_distribute_dataset requires, and it would report different ones).
for b in strategy.distribute_datasets_from_function(
    lambda ctx: [torch.randn(4, 3) * (ctx.input_pipeline_id + 1) for _ in range(3)]
):
    strategy.run(train, args=(b,))
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
res["param_checksum"] = strategy.gather(strategy.run(lambda: flat.sum().reshape(1)), axis=0).tolist()
res["extended"] = [list(strategy.extended.worker_devices), list(strategy.extended.parameter_devices)]
res["contract"] = {
    "process_index": strategy.extended.process_index,
    "replica_id": strategy.extended.replica_id,
    "num_replicas_in_sync": strategy.extended.num_replicas_in_sync,
    "device": str(strategy.extended.device),
    "step": strategy.extended.step,
    "broadcast": None,
    "all_reduce": None,
    "all_gather": None,
}
t = torch.tensor([float(rank)])
strategy.extended.broadcast([t], src=n - 1)
res["contract"]["broadcast"] = float(t)
res["contract"]["all_reduce"] = float(strategy.extended.all_reduce([torch.tensor([float(rank)])], "SUM")[0])
res["contract"]["all_gather"] = strategy.extended.all_gather(torch.full((rank + 1,), float(rank)), 0).tolist()

with open(os.path.join(out_dir, f"api_{rank}.json"), "w") as f:
    json.dump(res, f)
