"""K steps of a small MLP, compiled and/or under autocast, under a strategy; each replica saves its state.

Usage: python compiled.py OUT_DIR STRATEGY N VARIANT [VARIANT ...]
  STRATEGY: one_device | mirrored | central | mwms | mixed (mirrored and central variants in one
    program: both strategies run on the same N replica processes, one after the other)
  VARIANT: KIND,COMPILE,BACKEND,PRECISION,OPTIMIZER[,MODEL], each run with a fresh model, optimizer
    and strategy; replica k writes OUT_DIR/VARIANT/params_k.pt and losses_k.json
    KIND: the strategy kind (one_device | mirrored | central | mwms)
    COMPILE: none | model (torch.compile(model)) | step (@phalanx.function on the distributed step)
    PRECISION: fp32 | bf16 (torch.autocast on the CPU)
    OPTIMIZER: adam | sgd (momentum 0.9)
    MODEL: mlp (default) | cnn_nhwc (a small CNN in channels_last: weights, activations and so
      gradients whose memory order is not their NCHW index order)

:func:`reference` (plain PyTorch on one device, eager) is imported by the test and run in its own
process: it needs no replica.
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

STEPS, GLOBAL_BATCH, FEATURES = 8, 24, 10


def make_model(name="mlp"):
    if name == "cnn_nhwc":
        # The second convolution's weight (6, 4, 2, 2) in channels_last has strides (16, 1, 8, 4): its
        # gradient's bytes are not in NCHW order, which the gradient buckets must respect.
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 2, FEATURES // 2)),
            torch.nn.Conv2d(1, 4, 2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(4, 6, 2, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(6 * 2 * 3, 1),
        ).to(memory_format=torch.channels_last)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS * GLOBAL_BATCH, FEATURES, generator=g)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * torch.randn(STEPS * GLOBAL_BATCH, 1, generator=g)
    return [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, len(x), GLOBAL_BATCH)]


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def strategy_for(kind, n):
    if kind == "one_device":
        return px.OneDeviceStrategy("cpu")
    if kind == "central":
        return px.CentralStorageStrategy([f"cpu:{i}" for i in range(n)])
    if kind == "mwms":
        return px.MultiWorkerMirroredStrategy()
    # Small buckets, so that several all-reduces can start during backward.
    return px.MirroredStrategy([f"cpu:{i}" for i in range(n)], cross_device_ops=px.NcclAllReduce())


def reference(precision, opt_name, model_name="mlp"):
    """Plain PyTorch on one device, eager: (state dict, losses). Seeds the global generator."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    torch.manual_seed(0)
    model = make_model(model_name)
    opt = make_optimizer(opt_name, model.parameters())
    losses = []
    for x, y in data():
        with autocast:
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def run_variant(out, n, variant):
    kind, compile_, backend, precision, opt_name, *model_name = variant.split(",")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    strategy = strategy_for(kind, n)
    rank = px.process_index()
    torch.manual_seed(0 if rank == 0 else 99)  # the first sync must make replicas equal
    with strategy.scope():
        model = make_model(*model_name)
        opt = make_optimizer(opt_name, model.parameters())
    forward = torch.compile(model, backend=backend) if compile_ == "model" else model

    def train_step(x, y):
        with autocast:
            per_example = ((forward(x).float() - y) ** 2).mean(dim=1)
        loss = px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    def distributed_train_step(x, y):
        per_replica = strategy.run(train_step, args=(x, y))
        return strategy.reduce(px.ReduceOp.SUM, per_replica, axis=None)

    if compile_ == "step":
        distributed_train_step = px.function(distributed_train_step, backend=backend)
    losses = [float(distributed_train_step(x, y)) for x, y in strategy.experimental_distribute_dataset(data())]
    folder = os.path.join(out, variant)
    os.makedirs(folder, exist_ok=True)
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(folder, f"params_{rank}.pt")
    )
    with open(os.path.join(folder, f"losses_{rank}.json"), "w") as f:
        json.dump(losses, f)
    strategy.close()


def main():
    out, _, n, variants = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    for variant in variants:
        run_variant(out, n, variant)


if __name__ == "__main__":
    main()
