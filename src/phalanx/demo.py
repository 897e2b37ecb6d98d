"""``phalanx demo``: the seed notebook's model trained on scikit-learn's digits, per strategy.

The model is the notebook's MLP (Dense 128 relu, Dropout 0.2, Dense 10 softmax, Adam) on the
8x8 digits bundled with scikit-learn (no download). Each strategy runs as its own job: a
multi-replica strategy starts its replica processes itself. The table compares them.

Run ``phalanx demo --help`` for the options; ``python -m phalanx.demo --worker ...`` is one job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

STRATEGIES = ("one_device", "mirrored")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strategy",
        choices=(*STRATEGIES, "all"),
        default="all",
        help="which strategy to train under (all: one after the other, then a table)",
    )
    parser.add_argument("--replicas", type=int, default=2, metavar="N", help="CPU replicas for MirroredStrategy")
    parser.add_argument("--epochs", type=int, default=10, metavar="N", help="training epochs per strategy")
    parser.add_argument(
        "--batch-size", type=int, default=64, metavar="B", help="the GLOBAL batch size, split among the replicas"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the split, the weights and dropout")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)


def load_digits_split(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """Digits scaled to [0, 1], split 80/20 (float32 features, int64 labels)."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def seed_mlp(in_features: int = 64):
    """The notebook's model: Dense(128, relu), Dropout(0.2), Dense(10) (softmax is in the loss)."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(in_features, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(128, 10)
    )


def _make_strategy(name: str, replicas: int):
    import phalanx as px

    if name == "one_device":
        return px.OneDeviceStrategy("cpu:0")
    return px.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])


def train(args: argparse.Namespace) -> dict[str, Any]:
    """One job: trains under ``args.strategy`` and returns the figures for the table."""
    import numpy as np
    import torch

    import phalanx as px

    torch.manual_seed(args.seed)
    strategy = _make_strategy(args.strategy, args.replicas)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    with strategy.scope():
        model = seed_mlp(x_train.shape[1])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    batches = [
        (x_train[i : i + args.batch_size], y_train[i : i + args.batch_size])
        for i in range(0, len(x_train), args.batch_size)
    ]
    dataset = strategy.experimental_distribute_dataset(batches)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = px.nn.compute_average_loss(per_example, global_batch_size=args.batch_size)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    chief = strategy.extended.should_checkpoint
    bar = None
    if chief:
        from tqdm import tqdm

        bar = tqdm(
            total=args.epochs * len(batches),
            desc=f"{args.strategy} x{strategy.num_replicas_in_sync}",
            unit="step",
            file=sys.stderr,
            leave=False,
            disable=None,
        )  # None: off when not a TTY
    epoch_times = []
    for _ in range(args.epochs):
        model.train()
        start = time.perf_counter()
        total = torch.zeros(())
        for x, y in dataset:
            loss = strategy.reduce(px.ReduceOp.SUM, strategy.run(train_step, args=(x, y)), axis=None)
            total += loss
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.4f}")
        epoch_times.append(time.perf_counter() - start)
    if bar is not None:
        bar.close()

    model.eval()
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(x_test)).argmax(1) == torch.from_numpy(y_test)).float().mean())
    steady = epoch_times[1:] or epoch_times  # the first epoch includes start-up work
    epoch_time = float(np.median(steady))
    return {
        "strategy": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "epoch_time_s": epoch_time,
        "samples_per_s": len(x_train) / epoch_time,
        "final_accuracy": accuracy,
        "chief": chief,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'strategy':<22}{'replicas':>9}{'epoch time (s)':>16}{'samples/s':>12}{'final accuracy':>16}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['strategy']:<22}{r['replicas']:>9}{r['epoch_time_s']:>16.3f}"
            f"{r['samples_per_s']:>12.0f}{r['final_accuracy']:>16.4f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.worker:
        result = train(args)
        if result["chief"] and args.result_file:
            with open(args.result_file, "w") as f:
                json.dump(result, f)
        return 0
    rows = []
    names = STRATEGIES if args.strategy == "all" else (args.strategy,)
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [
                sys.executable,
                "-m",
                "phalanx.demo",
                "--worker",
                "--strategy",
                name,
                "--replicas",
                str(args.replicas),
                "--epochs",
                str(args.epochs),
                "--batch-size",
                str(args.batch_size),
                "--seed",
                str(args.seed),
                "--result-file",
                out,
            ]
            code = subprocess.call(cmd)
            if code != 0 or not os.path.exists(out):
                print(f"phalanx demo: the {name} job failed with exit code {code}", file=sys.stderr)
                return code or 1
            with open(out) as f:
                rows.append(json.load(f))
    print(
        f"\nphalanx demo: digits (8x8), seed MLP 64-128-10, Adam, global batch {args.batch_size}, "
        f"{args.epochs} epochs\n"
    )
    print(_table(rows))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m phalanx.demo")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
