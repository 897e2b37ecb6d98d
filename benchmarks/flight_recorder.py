"""What the flight recorder costs per collective on the CPU path: timed, and counted.

Usage: ``python -m benchmarks.flight_recorder [--rounds 15] [--calls 20000] [--no-callgrind] [--out FILE]``

The recorder's work per collective is what ``ProcessGroupCommunicator.all_reduce`` runs around a
shared-memory all-reduce: ``FlightRecorder.begin`` (one tuple into the ring, the step's source line
already known) and the store of its end time; a gradient bucket also goes through the strategy's
``labelled("gradient bucket", ...)`` wrapper. Measured here without the collective itself, whose few
microseconds on shared memory (hundreds on gloo) would drown it:

1. **Timed.** ``--calls`` calls of the recorder's work between the two ``perf_counter`` reads the
   communicator already made before the recorder, against the two reads alone; and a call through
   the bucket wrapper against a direct call. Interleaved rounds; the cost is the median over rounds
   of the difference per call.
2. **Counted.** The same loops under valgrind's callgrind: host instructions per call, the same
   whatever else runs on the machine (a shared 2-core VM moves timings by tens of percent).
3. **Once per step.** A step's first collective looks its source line up: a walk out of about ten
   library frames (as from a backward hook) to the user's frame. Timed per step, not per collective.

Writes ``benchmarks/results/flight_recorder.json`` (with the CPU model and the load average) and
prints it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from phalanx.comm.flight_recorder import FlightRecorder

RESULT = Path(__file__).resolve().parent / "results" / "flight_recorder.json"
DEPTH = 10  # library frames between a backward hook's collective and the user's `loss.backward()`


def loops(calls: int) -> dict:
    """The loops measured: name -> a function that runs ``calls`` iterations."""
    rec = FlightRecorder()
    rec.site = ("train.py", 7, "step")  # known: a step's later collectives, and every bucket after the first
    tensor = torch.ones(1024)
    pc = time.perf_counter

    # As the communicator's shared-memory path, less the collective: it times every collective
    # (two reads and a subtraction) with or without the recorder, which reuses both reads.
    def recorded(_: object = None) -> float:
        start = pc()
        slot = rec.begin("all_reduce", tensor, 7, start)
        end = rec.ends[slot] = pc()
        return end - start

    def bare(_: object = None) -> float:
        start = pc()
        end = pc()
        return end - start

    noop = lambda flat: flat  # noqa: E731
    wrapped = rec.labelled("gradient bucket", noop)

    def through_wrapper(_: object = None) -> None:
        wrapped(tensor)

    def direct(_: object = None) -> None:
        noop(tensor)

    def run(fn):
        return lambda: functools.reduce(lambda acc, _: fn(), range(calls), None)

    return {
        "recorded": run(recorded),
        "bare": run(bare),
        "bucket_wrapper": run(through_wrapper),
        "direct": run(direct),
    }


def timed(rounds: int, calls: int) -> dict:
    """Nanoseconds per call: the median over interleaved rounds of each pair's difference."""
    fns = loops(calls)
    pairs = {"record": ("recorded", "bare"), "bucket_wrapper": ("bucket_wrapper", "direct")}
    diffs: dict[str, list[float]] = {k: [] for k in pairs}
    for r in range(rounds + 1):  # round 0 warms up
        for key, (with_it, without) in pairs.items():
            order = (with_it, without) if r % 2 else (without, with_it)
            took = {}
            for name in order:
                start = time.perf_counter()
                fns[name]()
                took[name] = time.perf_counter() - start
            if r:
                diffs[key].append((took[with_it] - took[without]) / calls * 1e9)
    return {
        k: {"median_ns": round(statistics.median(v), 1), "rounds_ns": [round(x, 1) for x in v]}
        for k, v in diffs.items()
    }


def _library_chain(depth: int, leaf):
    """``leaf`` called under ``depth`` frames that the recorder counts as a library's (as torch's are)."""
    namespace: dict = {"__name__": "torch.autograd._benchmark_frames", "leaf": leaf}
    source = "def f0():\n    return leaf()\n" + "".join(
        f"def f{k}():\n    return f{k - 1}()\n" for k in range(1, depth)
    )
    exec(source, namespace)  # noqa: S102 - frames whose module reads as a library's
    return namespace[f"f{depth - 1}"]


def per_step(rounds: int, steps: int = 2000) -> dict:
    """Microseconds per step for the step's source line: a walk out of ``DEPTH`` library frames."""
    rec = FlightRecorder()
    tensor = torch.ones(8)

    def first_collective() -> None:  # as a step's first bucket: the line is looked up afresh
        saved = rec.enter_step(None)
        slot = rec.begin("all_reduce", tensor, 1, 0.0)
        rec.ends[slot] = 1.0
        rec.leave_step(saved)

    def later_collective() -> None:
        slot = rec.begin("all_reduce", tensor, 1, 0.0)
        rec.ends[slot] = 1.0

    walk, cached = _library_chain(DEPTH, first_collective), _library_chain(DEPTH, later_collective)
    rec.site = ("train.py", 7, "step")
    costs = []
    for r in range(rounds + 1):
        took = {}
        for name, fn in (("walk", walk), ("cached", cached)) if r % 2 else (("cached", cached), ("walk", walk)):
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            took[name] = time.perf_counter() - start
        if r:
            costs.append((took["walk"] - took["cached"]) / steps * 1e6)
    return {"library_frames": DEPTH, "median_us": round(statistics.median(costs), 2)}


def child(name: str, calls: int) -> None:
    loops(calls)[name]()  # the loop runs inside functools.reduce: callgrind collects only there


def counted(calls: int) -> dict | None:
    """Instructions per call (callgrind), or None without valgrind."""
    if shutil.which("valgrind") is None:
        return None
    per_call = {}
    for name in ("recorded", "bare", "bucket_wrapper", "direct"):
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--toggle-collect=functools_reduce",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "benchmarks.flight_recorder",
            "--child",
            name,
            "--calls",
            str(calls),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        found = re.search(r"Collected : (\d+)", out.stderr)
        if out.returncode != 0 or found is None:
            raise RuntimeError(f"{name}: valgrind failed ({out.returncode})\n{out.stderr[-3000:]}")
        per_call[name] = int(found.group(1)) / calls
    return {
        "instructions_per_call": {k: round(v, 1) for k, v in per_call.items()},
        "record": round(per_call["recorded"] - per_call["bare"], 1),
        "bucket_wrapper": round(per_call["bucket_wrapper"] - per_call["direct"], 1),
    }


def machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu_model": cpu,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--no-callgrind", action="store_true", help="time only")
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.calls)
        return None
    before = machine()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": before,
        "timed_per_collective": timed(args.rounds, args.calls),
        "per_step_source_line": per_step(args.rounds),
        "counted_per_collective": None if args.no_callgrind else counted(min(args.calls, 5000)),
    }
    result["machine"]["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    timing = result["timed_per_collective"]
    result["summary"] = {
        "record_ns_per_collective": timing["record"]["median_ns"],
        "bucket_wrapper_ns_per_bucket": timing["bucket_wrapper"]["median_ns"],
        "gradient_bucket_total_ns": round(timing["record"]["median_ns"] + timing["bucket_wrapper"]["median_ns"], 1),
        "under_1_us": timing["record"]["median_ns"] + timing["bucket_wrapper"]["median_ns"] < 1000,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
