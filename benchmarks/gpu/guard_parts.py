"""What each part of the consistency guard costs a step on the NCCL path (world size 1), in one process.

Usage (on a machine with a CUDA GPU, from the repository root)::

    python -m benchmarks.gpu.guard_parts OUT.json [--model large_mlp] [--rounds 9] [--steps 200]

Configurations, each its own copy of the model under ``MirroredStrategy`` with its process group
built at world size 1 (``PHALANX_SINGLE_REPLICA_COLLECTIVES=1``), timed in interleaved rounds:

- ``guard``: the guard as it runs (on a GPU its fields ride every ``GUARD_EVERY_GPU``-th pass);
- ``every_pass``: the guard with its fields on every pass (``PHALANX_GUARD_EVERY=1``, as before 28 Nov 2026);
- ``no_fields``: the guard without writing this replica's fields into the bucket (the pinned
  host-to-device copy and its event);
- ``no_readback``: the guard without reading the sum back (the device-to-host copy, its event,
  the wait for it one pass later and the check);
- ``no_fingerprint``: the guard never fingerprinting the parameters after the first step;
- ``off``: the guard turned off (``set_consistency_checks(False)``).

A diagnosis, not a mode: the parts are switched off by replacing methods of the one guard object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch

import phalanx as px
from benchmarks.models import EXTRA_MODELS, MODELS, workload
from phalanx.comm.guard import FieldGuard

PARTS = ("guard", "every_pass", "no_fields", "no_readback", "no_fingerprint", "off")


class _NoWrite(FieldGuard):
    __slots__ = ()

    def write(self, values, out) -> None:  # noqa: ANN001 - as FieldGuard.write
        return None


def build(part: str, model: str, device: torch.device):
    """One training step of ``model`` under a world-size-1 Mirrored with the guard cut as ``part`` says."""
    w = workload(model)
    x, y = (t.to(device) for t in w.batches(w.global_batch, 1)[0])
    os.environ["PHALANX_SINGLE_REPLICA_COLLECTIVES"] = "1"
    try:
        strategy = px.MirroredStrategy([str(device)])
    finally:
        del os.environ["PHALANX_SINGLE_REPLICA_COLLECTIVES"]
    guard = strategy.extended.consistency.active
    if part == "off":
        strategy.extended.set_consistency_checks(False)
    elif part == "no_fields":
        guard._fields.__class__ = _NoWrite
    elif part == "no_readback":
        guard.verify_later = lambda summed: None
    elif part == "every_pass":
        guard.check_every = 1
    elif part == "no_fingerprint":
        guard.every = 0
    torch.manual_seed(0)
    with strategy.scope():
        net = w.make()
    opt = w.make_optimizer(net.parameters())
    n = x.shape[0]

    def step() -> None:
        with w.autocast(device.type):
            out = net(x)
        loss = w.per_example_loss(out, y).sum() / n
        opt.zero_grad()
        loss.backward()
        opt.step()

    return lambda: strategy.run(step)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", choices=MODELS + EXTRA_MODELS, default="large_mlp")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the script")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    runs = {part: build(part, args.model, device) for part in PARTS}
    for step in runs.values():
        for _ in range(30):
            step()
    sync()
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    order = list(PARTS)
    for _ in range(args.rounds):
        order.reverse()
        for part in order:
            start = time.perf_counter()
            for _ in range(args.steps):
                runs[part]()
            sync()
            times[part].append((time.perf_counter() - start) / args.steps * 1e6)
    # Each part's cost: the median over rounds of (guard - without that part), paired by round.
    cost = {
        part: statistics.median(g - p for g, p in zip(times["guard"], times[part])) for part in PARTS if part != "guard"
    }
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "model": args.model,
        "us_per_step": {part: statistics.median(v) for part, v in times.items()},
        "guard_part_cost_us": cost,
        "per_round_us": times,
    }
    print(json.dumps({k: result[k] for k in ("device", "model", "us_per_step", "guard_part_cost_us")}, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
