"""The cost of the guard's periodic parameter fingerprint (``PHALANX_FINGERPRINT_EVERY``).

Usage: ``python -m benchmarks.fingerprint [--rounds 5] [--block-steps 100] [--models seed_mlp,large_mlp,cnn]``
(starts 2 CPU replicas itself).

On each benchmark model (global batch 256, Adam, MirroredStrategy x2 as ``python -m benchmarks``),
blocks of steps with a fingerprint every step, every ``FINGERPRINT_EVERY`` steps (the default) and
never after the first step (``fingerprint_every=0``) alternate, round after round (both replicas
switch together). Each step is timed on its own. Reported per setting: the median step and the
mean step (the mean carries the one step in N that fingerprints; the median does not). On a
loaded machine the differences between settings are mostly noise, so the fingerprint's own work
(``phalanx.comm.guard.digests`` over the model's parameters, the whole of it but a few integer
operations) is also timed directly, and its share of a step at the default is that time divided
by N and by the median step that never fingerprints.

Writes ``benchmarks/results/fingerprint.json`` on replica 0 and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import phalanx as px
from benchmarks.models import MODELS, batches, make_model
from phalanx.comm.guard import digests
from phalanx.config import FINGERPRINT_EVERY

GLOBAL = 256


def measure(strategy: px.Strategy, name: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model(name)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = list(strategy.experimental_distribute_dataset(batches(GLOBAL, 8)))
    ext = strategy.extended

    def step(x, y):
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL).backward()
        opt.step()
        opt.zero_grad()

    settings = (1, FINGERPRINT_EVERY, 0)
    times: dict[int, list[float]] = {every: [] for every in settings}
    i = 0
    for r in range(args.rounds + 1):  # round 0 warms every path up and is not counted
        for k in range(len(settings)):
            every = settings[(k + r) % len(settings)]
            ext.set_consistency_checks(True, fingerprint_every=every)  # every replica, at the same step
            for _ in range(args.block_steps):
                x, y = data[i % len(data)]
                i += 1
                start = time.perf_counter()
                strategy.run(step, args=(x, y))
                if r:
                    times[every].append(time.perf_counter() - start)
    ext.set_consistency_checks(True, fingerprint_every=FINGERPRINT_EVERY)
    median = {every: statistics.median(t) for every, t in times.items()}
    mean = {every: statistics.fmean(t) for every, t in times.items()}
    params = list(model.parameters())
    work = []
    for _ in range(20):
        start = time.perf_counter()
        digests(params)
        work.append(time.perf_counter() - start)
    cost = statistics.median(work)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_ms_median": {f"every_{e}" if e else "off": round(median[e] * 1e3, 4) for e in settings},
        "step_ms_mean": {f"every_{e}" if e else "off": round(mean[e] * 1e3, 4) for e in settings},
        "fingerprint_ms_timed_directly": round(cost * 1e3, 4),
        "fingerprint_ms_every_1_minus_off": round((median[1] - median[0]) * 1e3, 4),
        "share_of_step_every_1": round(cost / median[0], 4),
        f"share_of_step_every_{FINGERPRINT_EVERY}": round(cost / FINGERPRINT_EVERY / median[0], 5),
        "steps_per_setting": len(times[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-steps", type=int, default=100)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
    result = {
        "replicas": 2,
        "global_batch": GLOBAL,
        "default_every": FINGERPRINT_EVERY,
        "models": {name: measure(strategy, name, args) for name in args.models.split(",")},
    }
    if strategy.extended.should_checkpoint:
        out = Path(__file__).resolve().parent / "results" / "fingerprint.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    strategy.close()


if __name__ == "__main__":
    main()
