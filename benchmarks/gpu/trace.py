"""Where a GPU step's time goes, per configuration of ``benchmarks.hooks``: torch's profiler.

Usage (on a machine with a CUDA GPU, from the repository root)::

    python -m benchmarks.gpu.trace OUT_DIR [--model transformer_lm] [--steps 10]
        [--configs ddp_ws1,px_ws1,px_ws1_noguard]

For each configuration (built as ``benchmarks/hooks.py`` builds it, in this one process), after a
warm-up, ``--steps`` steps run under ``torch.profiler`` and ``OUT_DIR/trace.json`` records, per
configuration: the wall time per step; how busy the GPU was (the union of its kernels' and copies'
intervals over the wall time: below 1.0, the GPU waited for the host); the host's waits for the
device (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ... : count and time) and the top
host and device operations by their own time (also as text in ``OUT_DIR/trace.txt``). The guard's
cost is ``px_ws1`` against ``px_ws1_noguard``; what the NCCL path costs against DDP,
``px_ws1`` against ``ddp_ws1``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.hooks import CONFIGS, configs
from benchmarks.models import EXTRA_MODELS, MODELS

_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaStreamWaitEvent")


def _busy(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` (microseconds)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def trace(step, steps: int, device: str = "cuda") -> dict:
    """Profiles ``steps`` calls of ``step`` (after a warm-up) and summarises them."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(20):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - start) * 1e6
    events = prof.events()
    device = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    first = min((e.time_range.start for e in events), default=0)
    last = max((e.time_range.end for e in events), default=0)
    span = max(last - first, 1)
    waits: dict[str, list[float]] = {}
    for e in events:
        if e.name in _WAITS or e.name.startswith("cudaMemcpy"):
            waits.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    averages = prof.key_averages()
    host = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:25]
    dev = sorted(averages, key=lambda a: getattr(a, "self_device_time_total", 0), reverse=True)[:15]
    return {
        "wall_us_per_step": wall / steps,
        "gpu_busy": _busy(device) / span,
        "gpu_time_us_per_step": _busy(device) / steps,
        "host_waits": {k: {"count": len(v), "us": sum(v)} for k, v in waits.items()},
        "top_host": [[a.key, a.count, a.self_cpu_time_total / steps] for a in host],
        "top_device": [[a.key, a.count, getattr(a, "self_device_time_total", 0) / steps] for a in dev],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", choices=MODELS + EXTRA_MODELS, default="transformer_lm")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--configs", default="ddp_ws1,px_ws1,px_ws1_noguard")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the script")
    args = parser.parse_args(argv)
    only = tuple(c for c in args.configs.split(",") if c in CONFIGS)
    warnings.simplefilter("ignore")
    os.makedirs(args.out, exist_ok=True)
    runs = configs(args.device, args.model, only=only)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    report = {"gpu": gpu, "torch": torch.__version__, "model": args.model}
    lines = []
    for name, step in runs.items():
        r = report[name] = trace(step, args.steps, args.device)
        lines.append(
            f"==== {name}: {r['wall_us_per_step']:.0f} us/step wall, GPU busy {r['gpu_busy']:.3f}, "
            f"GPU {r['gpu_time_us_per_step']:.0f} us/step; waits {r['host_waits']}"
        )
        lines += [f"  host {us:9.1f} us/step {count:6d}x {key}" for key, count, us in r["top_host"]]
        lines += [f"  dev  {us:9.1f} us/step {count:6d}x {key}" for key, count, us in r["top_device"]]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "trace.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "trace.json"), "w") as f:
        json.dump(report, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
