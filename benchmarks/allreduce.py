"""All-reduce latency and bus bandwidth: phalanx's communicator against raw gloo, same processes.

Run as ``phalanx run -n 2 -m benchmarks.allreduce OUT_JSON [--rounds R]``. Sizes 4 KB to 64 MB,
float32; the two implementations alternate within every round so drift affects both alike.
busbw follows nccl-tests: ``bytes / time * 2 (n - 1) / n``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist

import phalanx as px
from phalanx._compat.torch import gloo_options

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _time(fn, tensor: torch.Tensor, reps: int) -> float:
    fn(tensor)  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        fn(tensor)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-bytes", type=int, default=SIZES[-1], help="largest message (default 64 MB)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = px.MultiWorkerMirroredStrategy()
    comm = strategy.extended.communicator
    n = comm.world_size
    opts = gloo_options(datetime.timedelta(seconds=300), "127.0.0.1")
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("bench-raw-gloo", comm.store), comm.rank, n, opts)
    impls = {
        "phalanx": lambda t: comm.all_reduce(t, "sum").wait(),
        "gloo": lambda t: gloo.allreduce([t]).wait(),
    }
    rows = []
    for size in [s for s in SIZES if s <= args.max_bytes]:
        tensor = torch.ones(size // 4)
        # About 64 MB per timing, 5 to 200 calls: enough calls that the ranks' skew leaving the
        # barrier (tens of us) is not charged to one 70 us all-reduce, as nccl-tests' iterations do.
        reps = max(5, min(200, (64 << 20) // size))
        times = {k: [] for k in impls}
        for _ in range(args.rounds):
            for name, fn in impls.items():
                comm.barrier()
                times[name].append(_time(fn, tensor, reps))
        row = {"bytes": size}
        for name, ts in times.items():
            t = statistics.median(ts)
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_busbw_gbps"] = size / t * 2 * (n - 1) / n / 1e9
        row["ratio_busbw"] = statistics.median(g / p for p, g in zip(times["phalanx"], times["gloo"]))
        rows.append(row)
    if comm.rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
