"""K steps of a small MLP under a strategy; each replica saves its parameters.

Usage: python equivalence.py OUT_DIR OPTIMIZER STRATEGY [N]
       python equivalence.py OUT_DIR --variants N VARIANT [VARIANT ...]
STRATEGY: reference (plain torch), or a family of tests/strategies.py (one_device, mirrored_cpu,
central_storage_cpu, multi_worker; the short names mirrored, central, mwms also work).
VARIANT: STRATEGY,OPTIMIZER[,CROSS_DEVICE_OPS] (CROSS_DEVICE_OPS: a name of tests/strategies.py,
mirrored only): each variant trains a fresh model with a fresh strategy on the same N processes (one
job for many variants: process start-up is most of what a run costs), replica k writing
OUT_DIR/VARIANT/params_k.pt. The first form writes OUT_DIR/params_k.pt; EQUIV_CROSS_DEVICE_OPS
names the cross-device ops there.

A test imports this module for :func:`reference` (plain PyTorch needs no process of its own).
"""

import faulthandler
import os
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # a hung job dumps its stacks (on the signal the test harness sends)
    from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

    faulthandler.register(stack_signal(), all_threads=True)
_TESTS = str(Path(__file__).resolve().parents[1])  # tests/: the strategy matrix
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import phalanx as px  # noqa: E402

import strategies  # noqa: E402

STEPS, GLOBAL_BATCH, FEATURES = 20, 24, 10


def make_model():
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS * GLOBAL_BATCH, FEATURES, generator=g)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * torch.randn(STEPS * GLOBAL_BATCH, 1, generator=g)
    return [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, len(x), GLOBAL_BATCH)]


def reference(opt_name):
    torch.manual_seed(0)
    model = make_model()
    opt = make_optimizer(opt_name, model.parameters())
    for x, y in data():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def distributed(strategy, opt_name):
    # A different seed per replica: the initial broadcast from replica 0 must make them equal.
    torch.manual_seed(0 if strategy.extended.should_checkpoint else 99)
    with strategy.scope():
        model = make_model()
        opt = make_optimizer(opt_name, model.parameters())

    def step(x, y):
        per_example = ((model(x) - y) ** 2).mean(dim=1)
        loss = px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    for x, y in strategy.experimental_distribute_dataset(data()):
        strategy.run(step, args=(x, y))
    return model


def run(out, opt_name, kind, n, cross_device_ops=""):
    """Trains under a fresh strategy of ``kind``; replica k saves its parameters in OUT/params_k.pt."""
    family = {"central": "central_storage_cpu", "mwms": "multi_worker", "mirrored": "mirrored_cpu"}.get(kind, kind)
    options = {"cross_device_ops_name": cross_device_ops} if kind == "mirrored" else {}
    strategy = strategies.make(family, n, **options)
    model, rank = distributed(strategy, opt_name), strategy.extended.process_index
    save(model, out, rank)
    return strategy


def save(model, out, rank):
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"params_{rank}.pt"))


if __name__ == "__main__":
    out = sys.argv[1]
    if sys.argv[2] == "--variants":
        n = int(sys.argv[3])
        for variant in sys.argv[4:]:
            kind, opt_name, *ops = variant.split(",")
            folder = os.path.join(out, variant)
            os.makedirs(folder, exist_ok=True)
            run(folder, opt_name, kind, n, *ops).close()
    elif sys.argv[3] == "reference":
        save(reference(sys.argv[2]), out, 0)
    else:
        run(out, sys.argv[2], sys.argv[3], int(sys.argv[4]), os.environ.get("EQUIV_CROSS_DEVICE_OPS", ""))
