"""Where a phalanx step on one GPU makes the host wait for the GPU, and where its host time goes.

Usage: ``python -m benchmarks.gpu.syncs OUT_DIR [--model transformer_lm]`` on a CUDA machine.

On a GPU the host must run ahead: a step that reads a GPU value (``.item()``, ``.tolist()``, a
copy to pageable memory) waits for every kernel queued before it. torch's sync debug mode warns
at each such read; this records the Python stack of each, per configuration: the raw loop,
OneDeviceStrategy, MirroredStrategy of one GPU, and MirroredStrategy with its NCCL group built at
world size 1 (PHALANX_SINGLE_REPLICA_COLLECTIVES=1). Then it times the four in interleaved passes
(paired ratios against the raw loop) and profiles the host time of 50 steps of each with cProfile.
Writes ``syncs.json`` and ``profile.txt`` into OUT_DIR.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
import traceback
import warnings

import torch

import phalanx as px
from benchmarks.models import workload

# Without CUDA the same code runs on the CPU (to check the script; there is nothing to synchronise).
CUDA = torch.cuda.is_available()
DEVICE = "cuda:0" if CUDA else "cpu"


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _configs(model_name: str) -> dict:
    here = torch.device(DEVICE)
    w = workload(model_name)
    data = [(x.to(here), y.to(here)) for x, y in w.batches(w.global_batch, 20)]
    runs = {}

    def make(strategy):
        torch.manual_seed(0)
        if strategy is None:
            model = w.make().to(here)
        else:
            with strategy.scope():
                model = w.make()
        opt = w.make_optimizer(model.parameters())

        def train_step(x, y):
            with w.autocast(here.type):
                out = model(x)
            loss = w.per_example_loss(out, y).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        if strategy is None:
            return train_step, data
        px_data = [(b[0], b[1]) for b in strategy.experimental_distribute_dataset(w.batches(w.global_batch, 20))]
        return (lambda x, y: strategy.run(train_step, args=(x, y))), px_data

    runs["raw"] = make(None)
    runs["px_one_device"] = make(px.OneDeviceStrategy(DEVICE))
    runs["px_mirrored"] = make(px.MirroredStrategy([DEVICE]))
    os.environ["PHALANX_SINGLE_REPLICA_COLLECTIVES"] = "1"
    nccl = px.MirroredStrategy([DEVICE])
    del os.environ["PHALANX_SINGLE_REPLICA_COLLECTIVES"]
    runs["px_mirrored_nccl"] = make(nccl)
    return runs


def _syncs(step, data) -> list[dict]:
    """The distinct host-device synchronisations of a few steps, each with its Python stack."""
    found: dict[str, dict] = {}
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=14)[:-1])
        entry = found.setdefault(stack, {"message": str(message)[:200], "count": 0, "stack": stack})
        entry["count"] += 1

    warnings.showwarning = record
    if CUDA:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for x, y in data[:5]:
                step(x, y)
    finally:
        if CUDA:
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    return sorted(found.values(), key=lambda e: -e["count"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="transformer_lm")
    parser.add_argument("--passes", type=int, default=6)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    runs = _configs(args.model)
    for step, data in runs.values():  # warm-up (and the first-step checks)
        for x, y in data:
            step(x, y)
    _sync()
    report: dict = {
        "gpu": torch.cuda.get_device_name(0) if CUDA else None,
        "torch": torch.__version__,
        "model": args.model,
    }
    report["syncs"] = {name: _syncs(step, data) for name, (step, data) in runs.items()}
    _sync()
    per_pass: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for _ in range(args.passes):
        order.reverse()
        for name in order:
            step, data = runs[name]
            start = time.perf_counter()
            for x, y in data:
                step(x, y)
            _sync()
            per_pass[name].append((time.perf_counter() - start) / len(data))
    report["step_ms"] = {n: statistics.median(v) * 1e3 for n, v in per_pass.items()}
    report["vs_raw"] = {
        n: statistics.median(r / p for r, p in zip(per_pass["raw"], v)) for n, v in per_pass.items() if n != "raw"
    }
    text = io.StringIO()
    for name, (step, data) in runs.items():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2):
            for x, y in data:
                step(x, y)
        _sync()
        profile.disable()
        text.write(f"==== {name}: 40 steps\n")
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    with open(os.path.join(args.out, "syncs.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "profile.txt"), "w") as f:
        f.write(text.getvalue())
    print(json.dumps({k: report[k] for k in ("step_ms", "vs_raw")}, indent=1))
    print({name: len(v) for name, v in report["syncs"].items()}, "distinct synchronising stacks per configuration")


if __name__ == "__main__":
    main()
