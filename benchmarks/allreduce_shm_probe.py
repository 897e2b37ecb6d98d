"""Probe: phalanx's shared-memory all-reduce vs gloo, 2 processes on this host.

Both run in the same two processes (``torch.set_num_threads(1)`` each, float32, in place),
interleaved in rounds with the order alternating, so host noise hits both alike. Reports the
median time per call, bus bandwidth (nccl-tests: busbw = bytes / time * 2(n-1)/n, = bytes / time
for n = 2) and the gloo/shm time ratio (the speed-up), median of per-round pairs. Rounds in
which other processes used more than 10% of the host's CPU (from /proc/stat minus our own CPU
time) are dropped, as long as 3 remain; the output says how many were used.

Usage:
    PYTHONPATH=src python benchmarks/allreduce_shm_probe.py [--rounds 15] [--sizes 4096 65536 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


BLOCK_S = 0.03  # target length of one timed block


def _calibrate(fn, t: torch.Tensor) -> int:
    """Calls per timed block for `fn` (rank 0's estimate, so every rank runs as many)."""
    for _ in range(2):
        fn(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        fn(t)
    n = torch.tensor([max(5, min(20000, int(BLOCK_S * 3 / (time.perf_counter() - t0))))])
    dist.broadcast(n, 0)
    return int(n.item())


def _busy_seconds() -> float:
    """CPU seconds the whole host has been busy (all CPUs), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _worker(rank: int, world: int, port: int, sizes: list[int], rounds: int, queue) -> None:
    from phalanx.comm.shm import ShmAllReduce

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world)
    shm = ShmAllReduce(rank, world, store, prefix="probe")
    impls = {"shm": shm.all_reduce, "gloo": dist.all_reduce}
    times: dict[tuple[str, int], list[float]] = {}
    foreign: list[float] = []
    try:
        iters = {
            (name, size): _calibrate(fn, torch.ones(size // 4))  # also warms up
            for size in sizes
            for name, fn in impls.items()
        }
        for rnd in range(rounds):
            dist.barrier()
            wall0, cpu0, busy0 = time.perf_counter(), time.process_time(), _busy_seconds()
            for size in sizes:
                t = torch.rand(size // 4)
                for name in list(impls) if rnd % 2 == 0 else list(impls)[::-1]:
                    fn, n = impls[name], iters[(name, size)]
                    fn(t)
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fn(t)
                    e = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64)
                    dist.all_reduce(e, op=dist.ReduceOp.MAX)  # the slower rank's time
                    times.setdefault((name, size), []).append(e.item())
            # Other tenants' CPU use during the round: host busy time minus our own.
            own = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
            dist.all_reduce(own)
            wall = time.perf_counter() - wall0
            foreign.append(max(0.0, _busy_seconds() - busy0 - own.item()) / (wall * os.cpu_count()))
        if rank == 0:
            queue.put((times, foreign))
    finally:
        shm.close()
        dist.destroy_process_group()


def measure(sizes: list[int] = SIZES, rounds: int = 15, world: int = 2, max_foreign: float = 0.10) -> list[dict]:
    """Measures shm vs gloo all-reduce, interleaved in rounds; returns one dict per size.

    Rounds in which other processes used more than ``max_foreign`` of the host's CPU are
    dropped (unless fewer than 3 would remain).

    Keys: ``bytes``, ``shm_us`` / ``gloo_us`` (median time per call), ``shm_busbw_GBps`` /
    ``gloo_busbw_GBps`` (from those medians), ``speedup`` (median over rounds of gloo/shm time),
    ``rounds`` (rounds used) and ``foreign_pct`` (median foreign CPU load of those rounds).
    """
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, world, store.port, sizes, rounds, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"probe workers failed: exit codes {[p.exitcode for p in procs]}")
    times, foreign = queue.get()
    keep = [i for i, f in enumerate(foreign) if f <= max_foreign]
    if len(keep) < 3:
        keep = list(range(rounds))
    factor = 2 * (world - 1) / world
    rows = []
    for size in sizes:
        shm = [times[("shm", size)][i] for i in keep]
        gloo = [times[("gloo", size)][i] for i in keep]
        ms, mg = statistics.median(shm), statistics.median(gloo)
        rows.append(
            {
                "bytes": size,
                "shm_us": ms * 1e6,
                "gloo_us": mg * 1e6,
                "shm_busbw_GBps": size / ms * factor / 1e9,
                "gloo_busbw_GBps": size / mg * factor / 1e9,
                "speedup": statistics.median(g / s for g, s in zip(gloo, shm)),
                "rounds": len(keep),
                "foreign_pct": 100 * statistics.median(foreign[i] for i in keep),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes (float32)")
    args = parser.parse_args()
    rows = measure(args.sizes, args.rounds)
    print(
        f"2 processes, float32, {rows[0]['rounds']}/{args.rounds} rounds used "
        f"(median foreign CPU load {rows[0]['foreign_pct']:.1f}%); busbw in GB/s"
    )
    print(f"{'bytes':>10} {'shm us':>10} {'gloo us':>10} {'shm busbw':>10} {'gloo busbw':>10} {'speedup':>8}")
    for r in rows:
        print(
            f"{r['bytes']:>10} {r['shm_us']:>10.1f} {r['gloo_us']:>10.1f} "
            f"{r['shm_busbw_GBps']:>10.2f} {r['gloo_busbw_GBps']:>10.2f} {r['speedup']:>7.2f}x"
        )


if __name__ == "__main__":
    main()
