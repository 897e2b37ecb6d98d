"""The cost of the consistency guard, and what ``no_sync()`` saves, on the seed MLP (784-128-10).

Usage: ``python -m benchmarks.consistency [--rounds 7] [--steps 200]`` (starts 2 CPU replicas itself).

Everything is measured in one job, in interleaved rounds, as ratios:

* **guard**: training steps with the guard on vs off (both replicas switch together, so the
  bucket sizes match), median of per-round paired ratios; and the guard's own work per step
  (encoding this replica's fields, decoding and comparing every replica's) timed directly, as a
  share of the median step.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
    ext = strategy.extended
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model("seed_mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = list(strategy.experimental_distribute_dataset(batches(GLOBAL, 16)))

    def step(x, y, sync=True, last=True):
        loss = px.nn.compute_average_loss(torch.nn.functional.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        if last:
            opt.step()
            opt.zero_grad()

    def steps(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            x, y = data[i % len(data)]
            strategy.run(step, args=(x, y))
        return (time.perf_counter() - start) / n

    def set_guard(on: bool) -> None:
        ext.set_consistency_checks(on)

    steps(50)  # warm up
    guard_ratios, on_times, off_times = [], [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        times = {}
        for on in order:
            set_guard(on)
            times[on] = steps(args.steps)
        set_guard(True)
        guard_ratios.append(times[True] / times[False])
        on_times.append(times[True])
        off_times.append(times[False])

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
        step_s = statistics.median(off_times)
        result = {
            "model": "seed_mlp 784-128-10",
            "replicas": 2,
            "global_batch": GLOBAL,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "step_ms_guard_off": round(step_s * 1e3, 4),
            "step_ms_guard_on": round(statistics.median(on_times) * 1e3, 4),
            "guard_on_over_off_median": round(statistics.median(guard_ratios), 4),
            "guard_on_over_off_range": [round(min(guard_ratios), 4), round(max(guard_ratios), 4)],
            "guard_work_us_per_step": round((encode_s + decode_s) * 1e6, 2),
            "guard_work_share_of_step": round((encode_s + decode_s) / step_s, 5),
            "guard_extra_bytes_per_step": mine.size(torch.float32) * 4,
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
