"""Save under one strategy, restore under another. Usage:

    python ckpt_roundtrip.py OUT_DIR STRATEGY [--restore CKPT_DIR] [--train K] [--save]
    python ckpt_roundtrip.py OUT_ROOT --chain CKPT_DIR K NAME:STRATEGY [NAME:STRATEGY ...]

STRATEGY: one_device | mirrored (2 CPU replicas, self-launched) | central (CentralStorage, 2 CPU
replicas) | mwms (run under ``phalanx run -n N``).

--restore: restore the latest checkpoint of CKPT_DIR (every object must match), then every
           replica dumps what it holds to OUT_DIR/restored_<rank>.pt.
--train K: K Adam steps, so that the optimizer has state.
--save:    save to OUT_DIR/ckpts; the chief dumps what was saved to OUT_DIR/saved.pt.

--chain:   stages in one program (multi-replica strategies run on the same processes, one after
           the other): stage NAME restores the previous stage's checkpoint (the first: CKPT_DIR's)
           under a fresh STRATEGY, trains K steps and saves, as ``OUT_ROOT/NAME STRATEGY --restore
           PREVIOUS --train K --save`` would; its strategy is closed before the next stage.

Dumps are plain {name: tensor or number} dicts, compared bitwise by the tests.
"""

import faulthandler
import os
import sys

import torch

from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

faulthandler.register(stack_signal(), all_threads=True)

import phalanx as px  # noqa: E402
from phalanx.checkpoint import Checkpoint, CheckpointManager, Counter, InputPosition, latest_checkpoint  # noqa: E402

GLOBAL_BATCH, FEATURES = 6, 5


def warm_up_adam():
    """Adam's first step makes torch set TORCHINDUCTOR_CACHE_DIR in os.environ, once per process.

    In-process tests call this at import, so pytest's env-leak check does not blame the first test
    that steps or loads an Adam optimizer.
    """
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.Adam([p]).step()


def build_strategy(kind):
    if kind == "one_device":
        return px.OneDeviceStrategy("cpu")
    if kind == "mirrored":
        return px.MirroredStrategy(["cpu:0", "cpu:1"])
    if kind == "central":
        return px.CentralStorageStrategy(["cpu:0", "cpu:1"])
    if kind == "mwms":
        return px.MultiWorkerMirroredStrategy()
    raise ValueError(kind)


def build_objects(seed=0):
    """The model and training state; call inside a strategy's scope (or with none)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 7), torch.nn.BatchNorm1d(7), torch.nn.Tanh(), torch.nn.Linear(7, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    objects = dict(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        step=Counter(),
        input=InputPosition(),
        tokens=torch.zeros((), dtype=torch.int64),
    )
    return objects


def batches(n):
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(GLOBAL_BATCH, FEATURES, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)) for _ in range(n)
    ]


def dump(objects):
    """Everything a checkpoint should carry, as a flat dict of tensors and numbers."""
    out = {f"model/{k}": v.detach().clone() for k, v in objects["model"].state_dict().items()}
    opt = objects["optimizer"].state_dict()
    for pid, state in opt["state"].items():
        for name, value in state.items():
            out[f"optimizer/{pid}/{name}"] = value.clone() if isinstance(value, torch.Tensor) else value
    out["optimizer/lr"] = opt["param_groups"][0]["lr"]
    out["scheduler/last_epoch"] = objects["scheduler"].state_dict()["last_epoch"]
    out["step"] = objects["step"].value
    out["input"] = (objects["input"].epoch, objects["input"].batch)
    out["tokens"] = objects["tokens"].clone()
    return out


def train(strategy, objects, k):
    model, optimizer, scheduler = objects["model"], objects["optimizer"], objects["scheduler"]

    def step(x, y):
        loss = px.nn.compute_average_loss(((model(x) - y) ** 2).mean(1), global_batch_size=GLOBAL_BATCH)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for batch in objects["input"].iterate(strategy.experimental_distribute_dataset(batches(k))):
        strategy.run(step, args=batch)
        scheduler.step()
        objects["step"].assign_add(1)
        objects["tokens"] += GLOBAL_BATCH


def run(out, kind, restore, k, save):
    strategy = build_strategy(kind)
    rank = strategy.extended.process_index
    with strategy.scope():
        objects = build_objects(seed=100 + rank)  # different per replica: restore must overwrite all
        ckpt = Checkpoint(**objects)
    if restore:
        ckpt.restore(latest_checkpoint(restore)).assert_consumed()
        torch.save(dump(objects), os.path.join(out, f"restored_{rank}.pt"))
    if k:
        train(strategy, objects, k)
    if save:
        CheckpointManager(ckpt, os.path.join(out, "ckpts"), max_to_keep=2).save()
        if strategy.extended.should_checkpoint:
            torch.save(dump(objects), os.path.join(out, "saved.pt"))
    return strategy


def chain(root, restore, k, stages):
    for stage in stages:
        name, kind = stage.split(":")
        out = os.path.join(root, name)
        os.makedirs(out, exist_ok=True)
        run(out, kind, restore, k, save=True).close()
        restore = os.path.join(out, "ckpts")


def main(argv):
    if argv[1] == "--chain":
        chain(argv[0], argv[2], int(argv[3]), argv[4:])
        return
    out, kind = argv[0], argv[1]
    restore = argv[argv.index("--restore") + 1] if "--restore" in argv else None
    k = int(argv[argv.index("--train") + 1]) if "--train" in argv else 0
    run(out, kind, restore, k, "--save" in argv)


if __name__ == "__main__":
    main(sys.argv[1:])
