"""What the distribution layer costs a step at world size 1, against DDP, in one process.

Usage: ``python -m benchmarks.hooks [--device cpu|cuda] [--model M] [--rounds 9] [--steps 300] [--out FILE.json]``

Every configuration trains its own copy of one workload (``benchmarks/models.py``) in this one
process, and they are timed in interleaved rounds (the order reversed every round, so a machine
that gets busier or quieter shifts them all alike):

- ``raw``: the plain loop;
- ``ddp_ws1``: the same model in ``DistributedDataParallel`` over a process group of world size 1
  (gloo on the CPU, NCCL on a GPU): DDP's C++ reducer, its hooks and one all-reduce per bucket;
- ``px_one_device``: ``OneDeviceStrategy``;
- ``px_mirrored``: ``MirroredStrategy`` of one replica, which runs no collective;
- ``px_ws1``: the same with its process group built anyway (``PHALANX_SINGLE_REPLICA_COLLECTIVES=1``):
  the path every multi-GPU job runs, phalanx's gradient hooks (``comm/reducer.py``), the
  consistency guard riding in the first bucket and one all-reduce per bucket;
- ``px_ws1_noguard``: ``px_ws1`` with the guard off (``set_consistency_checks(False)``): what the
  guard, which DDP has no counterpart of, costs.

Each figure is the median over the rounds of the per-step time in microseconds. The report gives:

- ``hook cost vs DDP``: ``(px_ws1 - px_mirrored) / (ddp_ws1 - raw)``, what phalanx's gradient
  exchange costs a step over what DDP's costs (1.0: as much; below: less), as the ratio of the
  medians and as the median of the per-round ratios; ``without guard`` the same with
  ``px_ws1_noguard``. On a CPU this is the proxy of the GPU figures: host time is what a GPU
  step loses to the distribution layer;
- ``speed``: each configuration's steps per second over the raw loop's and over DDP's (the
  median of per-round ratios): on a GPU, ``px_ws1 / ddp_ws1`` is the NCCL path against DDP;
- ``guard share``: ``(px_ws1 - px_ws1_noguard) / px_ws1``, the guard's part of a step.

The default model is ``transformer_small``, the language model at a small width: about 75
parameter tensors and little compute, so per-parameter host work shows (the proxy of the
transformer on a GPU). On this 2-core VM gloo's hand-over to its worker thread and back (DDP's
too) varies from run to run by tens of microseconds: compare figures of one run only. On a GPU
each timed block ends with ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

import phalanx as px
from benchmarks.__main__ import machine
from benchmarks.models import EXTRA_MODELS, MODELS, workload
from phalanx.launch.env import free_port

CONFIGS = ("raw", "ddp_ws1", "px_one_device", "px_mirrored", "px_ws1", "px_ws1_noguard")


def configs(
    device: str, model: str = "transformer_small", batch: int | None = None, only: tuple[str, ...] = CONFIGS
) -> dict[str, Callable[[], None]]:
    """One training step per configuration (see the module docstring), each with its own model.

    Args:
        device: ``cpu`` or ``cuda``.
        model: a workload of ``benchmarks/models.py``.
        batch: examples per step (default: the workload's global batch).
        only: the configurations to build.

    Initialises torch's default process group (world size 1) for DDP if nothing has yet.
    """
    w = workload(model)
    here = torch.device("cuda:0" if device == "cuda" else "cpu")
    x, y = (t.to(here) for t in w.batches(batch or w.global_batch, 1)[0])
    if "ddp_ws1" in only and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
        )

    def make(strategy: px.Strategy | None = None, ddp: bool = False) -> Callable[[], None]:
        torch.manual_seed(0)
        if strategy is None:
            model_ = w.make().to(here)
            if ddp:
                model_ = torch.nn.parallel.DistributedDataParallel(model_)
        else:
            with strategy.scope():
                model_ = w.make()
        opt = w.make_optimizer(model_.parameters())
        n = x.shape[0]

        def step() -> None:
            with w.autocast(here.type):
                out = model_(x)
            loss = w.per_example_loss(out, y).sum() / n
            opt.zero_grad()
            loss.backward()
            opt.step()

        if strategy is None:
            return step
        return lambda: strategy.run(step)

    def ws1(guard: bool) -> Callable[[], None]:
        os.environ["PHALANX_SINGLE_REPLICA_COLLECTIVES"] = "1"
        try:
            strategy = px.MirroredStrategy([str(here)])
        finally:
            del os.environ["PHALANX_SINGLE_REPLICA_COLLECTIVES"]
        strategy.extended.set_consistency_checks(guard)
        return make(strategy)

    builders: dict[str, Callable[[], Callable[[], None]]] = {
        "raw": make,
        "ddp_ws1": lambda: make(ddp=True),
        "px_one_device": lambda: make(px.OneDeviceStrategy(str(here))),
        "px_mirrored": lambda: make(px.MirroredStrategy([str(here)])),
        "px_ws1": lambda: ws1(True),
        "px_ws1_noguard": lambda: ws1(False),
    }
    return {name: builders[name]() for name in only}


def measure(runs: dict[str, Callable[[], None]], rounds: int, steps: int, device: str) -> dict[str, list[float]]:
    """Per-step microseconds of each configuration, one figure per round; rounds interleaved."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for step in runs.values():  # warm-up: first-step checks, allocator, caches
        for _ in range(min(50, max(5, steps // 4))):
            step()
    sync()
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for _ in range(rounds):
        order.reverse()
        for name in order:
            step = runs[name]
            start = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    return times


def summary(times: dict[str, list[float]]) -> dict:
    """Medians, the hook cost of phalanx's gradient exchange against DDP's, speeds and the guard's share."""
    med = {name: statistics.median(v) for name, v in times.items()}
    out: dict = {"us_per_step": med}
    if not all(name in times for name in CONFIGS):
        return out
    ddp = med["ddp_ws1"] - med["raw"]
    out["hook_cost_us"] = {
        "ddp": ddp,
        "phalanx": med["px_ws1"] - med["px_mirrored"],
        "phalanx_without_guard": med["px_ws1_noguard"] - med["px_mirrored"],
    }
    for suffix, config in (("", "px_ws1"), ("_without_guard", "px_ws1_noguard")):
        phalanx = out["hook_cost_us"]["phalanx" + suffix]
        out["hook_cost_vs_ddp" + suffix] = phalanx / ddp if ddp > 0 else None
        per_round = [
            (p - m) / (d - r)
            for r, d, m, p in zip(times["raw"], times["ddp_ws1"], times["px_mirrored"], times[config])
            if d > r
        ]
        out["hook_cost_vs_ddp" + suffix + "_per_round_median"] = statistics.median(per_round) if per_round else None

    def speed(a: str, b: str) -> float:  # steps/s of a over steps/s of b, median of per-round ratios
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))

    out["speed_vs_raw"] = {c: speed(c, "raw") for c in CONFIGS if c != "raw"}
    out["speed_vs_ddp"] = {c: speed(c, "ddp_ws1") for c in ("px_ws1", "px_ws1_noguard")}
    out["guard_share_of_step"] = statistics.median(
        (g - n) / g for g, n in zip(times["px_ws1"], times["px_ws1_noguard"])
    )
    return out


def table(result: dict) -> str:
    """The result as text."""
    lines = [f"{name:14s} {us:10.1f} us/step" for name, us in result["us_per_step"].items()]
    if "hook_cost_vs_ddp" in result:
        cost = result["hook_cost_us"]
        lines.append(
            f"hook cost: phalanx {cost['phalanx']:.1f} us ({cost['phalanx_without_guard']:.1f} without the guard), "
            f"DDP {cost['ddp']:.1f} us"
        )
        for suffix, label in (("", ""), ("_without_guard", " without the guard")):
            if result["hook_cost_vs_ddp" + suffix] is not None:
                lines.append(
                    f"hook cost vs DDP{label}: {result['hook_cost_vs_ddp' + suffix]:.2f} "
                    f"(median of per-round ratios {result['hook_cost_vs_ddp' + suffix + '_per_round_median']:.2f})"
                )
        raw, ddp = result["speed_vs_raw"], result["speed_vs_ddp"]
        lines.append(
            "speed vs raw: "
            + ", ".join(f"{c} {v:.3f}" for c, v in raw.items())
            + f"; NCCL path vs DDP: {ddp['px_ws1']:.3f} (guard off {ddp['px_ws1_noguard']:.3f})"
        )
        lines.append(f"guard share of a step: {result['guard_share_of_step'] * 100:.1f} %")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=MODELS + EXTRA_MODELS, default="transformer_small")
    parser.add_argument("--batch", type=int, help="examples per step (default: the workload's global batch)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300, help="steps per configuration per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CPU's intra-op pool)")
    parser.add_argument("--out", help="write the result as JSON to this file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # DDP's and phalanx's one-replica notices, once each
    runs = configs(args.device, args.model, args.batch)
    times = measure(runs, args.rounds, args.steps, args.device)
    result = {
        "device": args.device,
        "machine": machine(args.device),
        "model": args.model,
        "parameter_tensors": sum(1 for _ in workload(args.model).make().parameters()),
        "rounds": args.rounds,
        "steps": args.steps,
        "threads": args.threads,
        **summary(times),
        "per_round_us": times,
    }
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
