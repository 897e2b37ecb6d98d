"""``distribute_datasets_from_function`` as TF feeds it, checked on real replica processes (issue 28).

Usage: python input_from_function.py OUT_DIR KIND
KIND: ``mirrored`` or ``central`` (2 replicas on one worker; the script starts its second replica
itself) or ``mwms`` (MultiWorkerMirroredStrategy, one replica per worker; TF_CONFIG names the
workers). Each check is independent: a failure is recorded (its type and text) and the script
goes on, so one run reports every check. Writes OUT_DIR/fn_<rank>.json.
"""

import json
import os
import random
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "torch")
import numpy as np  # noqa: E402
import torch  # noqa: E402

import phalanx as px  # noqa: E402

out, kind = sys.argv[1], sys.argv[2]
if kind == "mirrored":
    strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
elif kind == "central":
    strategy = px.CentralStorageStrategy(["cpu:0", "cpu:1"])
else:
    strategy = px.MultiWorkerMirroredStrategy()
rank = strategy.extended.process_index
# Each process's own random state differs, as in any unseeded program.
torch.manual_seed(1000 + rank)
np.random.seed(1000 + rank)
random.seed(1000 + rank)
res = {}


def check(name):
    def deco(fn):
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
            res[name] = {"error": type(e).__name__, "text": str(e)[:500], "tb": traceback.format_exc()[-1500:]}
        return fn

    return deco


def own(value):
    """This replica's part of a per-replica value, as a list (or a number)."""
    seen = []
    strategy.run(lambda t: seen.append(t.tolist()), args=(value,))
    return seen[0]


def batched(n, global_batch=8):
    """A dataset_fn that does not shard: range(n) in batches of the per-replica batch size."""
    contexts = []

    def dataset_fn(ctx):
        contexts.append([ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync])
        b = ctx.get_per_replica_batch_size(global_batch)
        return [torch.arange(i, min(i + b, n)) for i in range(0, n, b)]

    return dataset_fn, contexts


def collect(dataset):
    return [own(x) for x in dataset]


@check("contexts")
def _():
    fn, contexts = batched(16)
    strategy.distribute_datasets_from_function(fn)
    return contexts


@check("nonshard")
def _():
    # TF's MirroredStrategy: one pipeline per worker, its batches fed to the worker's replicas in turn.
    return collect(strategy.distribute_datasets_from_function(batched(16)[0]))


@check("uneven")
def _():
    return {str(n): collect(strategy.distribute_datasets_from_function(batched(n)[0])) for n in (20, 18, 4)}


@check("average_loss")
def _():
    # compute_average_loss divides by the examples of the step over all replicas (20 = 8 + 8 + 4).
    losses = []

    def step(x):
        losses.append(float(px.nn.compute_average_loss(torch.ones(x.shape[0]))))

    for x in strategy.distribute_datasets_from_function(batched(20)[0]):
        strategy.run(step, args=(x,))
    return losses


@check("unbatched")
def _():
    # Elements without a batch dimension: each replica gets one element per step.
    return {
        "tensors": collect(strategy.distribute_datasets_from_function(lambda ctx: list(torch.arange(5)))),
        "ints": collect(strategy.distribute_datasets_from_function(lambda ctx: range(5))),
        "sharded": collect(
            strategy.distribute_datasets_from_function(
                lambda ctx: list(torch.arange(10)[ctx.input_pipeline_id :: ctx.num_input_pipelines])
            )
        ),
        "dicts": [
            {k: own(v) for k, v in x.items()}
            for x in strategy.distribute_datasets_from_function(
                lambda ctx: [{"a": torch.tensor(i), "b": torch.tensor(2.0 * i)} for i in range(4)]
            )
        ],
    }


@check("uneven_workers")
def _():
    # Pipelines whose length depends on the worker: on several workers the ones that run out are
    # fed TF's dummy values (an empty batch, a scalar 0) until all have.
    scalars = strategy.distribute_datasets_from_function(lambda ctx: range(4 + ctx.input_pipeline_id))
    return {
        "scalars": collect(scalars),
        "batches": collect(
            strategy.distribute_datasets_from_function(
                lambda ctx: [torch.arange(i, i + 4) for i in range(0, 16 + 4 * ctx.input_pipeline_id, 4)]
            )
        ),
    }


@check("per_replica")
def _():
    # The per-replica-process pipeline (TF's InputReplicationMode.PER_REPLICA): one pipeline per replica.
    fn, contexts = batched(16)
    options = px.InputOptions(experimental_replication_mode=px.InputReplicationMode.PER_REPLICA)
    return {"contexts": contexts, "batches": collect(strategy.distribute_datasets_from_function(fn, options))}


@check("shuffle")
def _():
    # An unseeded shuffling DataLoader made by dataset_fn: both processes of the worker must read the
    # same stream, so the replicas' batches are disjoint and cover every example once per epoch.
    def dataset_fn(ctx):
        ds = torch.utils.data.TensorDataset(torch.arange(32, dtype=torch.float32))
        return torch.utils.data.DataLoader(ds, batch_size=ctx.get_per_replica_batch_size(8), shuffle=True)

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    epochs = []
    for _ in range(2):
        rows = []
        for (x,) in dataset:
            rows.append(strategy.gather(strategy.run(lambda t: t, args=(x,)), axis=0).tolist())
        epochs.append(rows)
    return {"epochs": epochs, "own_random": float(torch.rand(1))}


@check("random_data")
def _():
    # Data drawn from the global generator inside dataset_fn (the same on the worker's processes).
    dataset = strategy.distribute_datasets_from_function(lambda ctx: [torch.randn(2) for _ in range(4)])
    return [strategy.gather(strategy.run(lambda t: t.reshape(1, 2), args=(x,)), axis=0).tolist() for x in dataset]


@check("mismatch")
def _():
    # A pipeline with its own unseeded generator (OS entropy) cannot be aligned: must be detected.
    def dataset_fn(ctx):
        rng = np.random.default_rng()
        return [torch.as_tensor(rng.random(4)) for _ in range(4)]

    for x in strategy.distribute_datasets_from_function(dataset_fn):
        strategy.run(lambda t: t, args=(x,))
    return "no error"


@check("distribute_dataset_unbatched")
def _():
    # experimental_distribute_dataset needs batches (TF: IndexError from its rebatching).
    try:
        list(strategy.experimental_distribute_dataset(list(torch.arange(8))))
    except Exception as e:  # noqa: BLE001 - recorded
        return {"type": type(e).__name__, "index_error": isinstance(e, IndexError), "text": str(e)[:300]}
    return "no error"


with open(os.path.join(out, f"fn_{rank}.json"), "w") as f:
    json.dump(res, f)
