"""The cost of the consistency guard, and what ``no_sync()`` saves, on the seed MLP (784-128-10).

Usage: ``python -m benchmarks.consistency [--rounds 9] [--blocks 10] [--block-steps 20]``
(starts 2 CPU replicas itself).

Everything is measured in one job, in interleaved rounds, as ratios:

* **guard**, under MirroredStrategy x2 (the guard rides on the gradient all-reduce) and then
  CentralStorageStrategy x2 on the same replicas (on one host its gradient buckets are all-reduced
  through shared memory too, and the guard rides on the first one and on the step's two barriers;
  see ``phalanx.strategies.central_storage``): every round alternates blocks of steps with the guard
  on and off (both replicas switch together, so the collectives match), each step timed on its
  own. A round's ratio is the median step with the guard on over the median step with it off
  (medians: a step the OS preempted on a loaded machine does not move them); the result gives
  the median ratio over the rounds and its range. The guard's own work per step (encoding this
  replica's fields, decoding and comparing every replica's) is also timed directly, as a share
  of the median step.
* **no_sync**: 4 micro-batches accumulated per optimizer step, synchronising every backward vs
  only the last one (``strategy.extended.no_sync()``): time per optimizer step and gradient
  bytes all-reduced per optimizer step.

Writes ``benchmarks/results/consistency.json`` on replica 0 and prints a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

import phalanx as px
from benchmarks.models import batches, make_model

GLOBAL = 64


def build(kind: str) -> tuple[px.Strategy, torch.nn.Module, torch.optim.Optimizer, list]:
    strategy = (px.MirroredStrategy if kind == "mirrored" else px.CentralStorageStrategy)(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model("seed_mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return strategy, model, opt, list(strategy.experimental_distribute_dataset(batches(GLOBAL, 16)))


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer):
    def step(x, y, last=True):
        loss = px.nn.compute_average_loss(torch.nn.functional.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        if last:
            opt.step()
            opt.zero_grad()

    return step


def guard_cost(kind: str, args: argparse.Namespace) -> dict:
    """Guard on over guard off, per step, in finely interleaved blocks (see the module docstring)."""
    strategy, model, opt, data = build(kind)
    ext, step = strategy.extended, make_step(model, opt)
    clock, i = time.perf_counter, 0

    def block(on: bool, out: list[float]) -> None:
        nonlocal i
        ext.set_consistency_checks(on)  # every replica, at the same step
        for _ in range(args.block_steps):
            x, y = data[i % len(data)]
            i += 1
            start = clock()
            strategy.run(step, args=(x, y))
            out.append(clock() - start)

    block(True, [])  # warm up both paths
    block(False, [])
    ratios, on_all, off_all = [], [], []
    for r in range(args.rounds):
        on, off = [], []
        for b in range(args.blocks):
            block((b + r) % 2 == 0, on if (b + r) % 2 == 0 else off)
        ratios.append(statistics.median(on) / statistics.median(off))
        on_all += on
        off_all += off
    ext.set_consistency_checks(True)
    strategy.close()
    return {
        "step_ms_guard_off_median": round(statistics.median(off_all) * 1e3, 4),
        "step_ms_guard_on_median": round(statistics.median(on_all) * 1e3, 4),
        "guard_on_over_off_median": round(statistics.median(ratios), 4),
        "guard_on_over_off_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "guard_on_over_off_per_round": [round(x, 4) for x in ratios],
        "steps_per_setting": len(on_all),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--blocks", type=int, default=10, help="blocks per round, alternating guard on and off")
    parser.add_argument("--block-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200, help="steps per round of the no_sync comparison")
    args = parser.parse_args()
    guard = {kind: guard_cost(kind, args) for kind in ("mirrored", "central_storage")}

    strategy, model, opt, data = build("mirrored")
    ext, step = strategy.extended, make_step(model, opt)
    step_s = guard["mirrored"]["step_ms_guard_off_median"] / 1e3

    # The guard's own work per step, timed directly: encoding this replica's slot and checking the
    # summed rows of agreeing replicas (the first bucket's torch.cat copies the slot with the gradients).
    from phalanx.comm.guard import FieldGuard

    world = ext.num_processes
    values = (ext.step, GLOBAL, 1, 0)
    mine = FieldGuard(ext.process_index, world)
    summed = sum(FieldGuard(r, world).encode(values, torch.float32).clone() for r in range(world))
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        mine.encode(values, torch.float32, "cpu")
    encode_s = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        mine.check(summed, ext.process_name)
    decode_s = (time.perf_counter() - start) / n

    # Accumulation over 4 micro-batches: sync every backward vs no_sync() on the first three.
    micro = 4
    bucket_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def accumulate(use_no_sync: bool, n: int) -> float:
        start = time.perf_counter()
        for i in range(n * micro):
            x, y = data[i % len(data)]
            last = (i + 1) % micro == 0
            with ext.no_sync() if use_no_sync and not last else contextlib.nullcontext():
                strategy.run(step, args=(x, y), kwargs={"last": last})
        return (time.perf_counter() - start) / n

    accumulate(True, 10)
    sync_ratios, sync_times, nosync_times = [], [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        times = {}
        for use in order:
            times[use] = accumulate(use, args.steps // micro)
        sync_ratios.append(times[True] / times[False])
        nosync_times.append(times[True])
        sync_times.append(times[False])

    if ext.should_checkpoint:
        result = {
            "model": "seed_mlp 784-128-10",
            "replicas": 2,
            "global_batch": GLOBAL,
            "rounds": args.rounds,
            "blocks_per_round": args.blocks,
            "steps_per_block": args.block_steps,
            "guard": guard,
            "guard_work_us_per_step": round((encode_s + decode_s) * 1e6, 2),
            "guard_work_share_of_mirrored_step": round((encode_s + decode_s) / step_s, 5),
            "guard_extra_bytes_per_step": {
                "mirrored": mine.size(torch.float32) * 4,
                # in the first bucket, and in the step's two barriers (an int64 of 8 bytes without it)
                "central_storage": mine.size(torch.float32) * 4 + 2 * (mine.size(torch.int64) * 8 - 8),
            },
            "accumulation_micro_batches": micro,
            "optimizer_step_ms_sync_every_backward": round(statistics.median(sync_times) * 1e3, 3),
            "optimizer_step_ms_no_sync": round(statistics.median(nosync_times) * 1e3, 3),
            "no_sync_over_sync_median": round(statistics.median(sync_ratios), 4),
            "allreduce_bytes_per_optimizer_step_sync": micro * bucket_bytes,
            "allreduce_bytes_per_optimizer_step_no_sync": bucket_bytes,
            "allreduces_per_optimizer_step": {"sync": micro, "no_sync": 1},
        }
        out = Path(__file__).resolve().parent / "results" / "consistency.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    strategy.close()


if __name__ == "__main__":
    main()
