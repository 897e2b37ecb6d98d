"""Asynchronous parameter-server training vs synchronous all-reduce, with 1-3 workers and a straggler.

    python -m benchmarks.ps [--seconds 4] [--out benchmarks/results/ps.json]

Jobs (real processes on this host; each worker trains an MLP on batches of 64 with SGD):

* ``sync``: MultiWorkerMirroredStrategy on k = 1, 2, 3 processes (``phalanx run -n k``): every step
  all-reduces the gradients, so every worker waits for the slowest.
* ``async``: ParameterServerStrategy, one parameter server, 3 workers (``phalanx run --ps 1
  --workers 3``); the chief schedules one step per function. 2 and 1 workers are measured in the
  same job after shutting workers down (one cluster start instead of three).
* ``slow``: the same 3-worker jobs with worker 0 made 2x slower: after each step it sleeps as long
  as a step takes (a straggler: another job on its machine, a slower machine; it uses no CPU
  here, so the other workers are not slowed by it on this small host).
* ``async_3_8_steps_per_function``: 8 steps per scheduled function, which spreads the per-function
  costs (pickling on the chief, dispatch) over 8 steps; each step still sends its gradients and
  reads the variables back.

Each asynchronous step costs two round trips to the parameter server (read the variables, send
the gradients: the model's size each way) plus, per function, the chief's pickling of it; with
this small model (a 4 ms step) that overhead dominates, so synchronous all-reduce is faster when
all workers are equally fast; a straggler costs the synchronous job much more.

Figures are *worker steps/s* (batches of 64 processed per second by the whole job: a synchronous
step of k workers counts k) and samples/s; ratios compare them. On a 2-core host, 3 workers plus a
server and a chief share two cores, so absolute scaling is bounded by the host, not by phalanx;
the straggler comparison is the one asynchronous training exists for. Runs in about 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BATCH, IN, HIDDEN, OUT = 64, 256, 512, 10


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


def _batches(seed: int, n: int = 16) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)) for _ in range(n)]


# ------------------------------------------------------------------------------------------- jobs
def sync_job(out: str, seconds: float, with_slow: bool) -> None:
    import phalanx as px

    strategy = px.MultiWorkerMirroredStrategy()
    k, rank = strategy.num_replicas_in_sync, strategy.extended.process_index
    with strategy.scope():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = _batches(rank)
    slow = {"s": 0.0}

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y) / k
        opt.zero_grad()
        loss.backward()
        opt.step()
        if slow["s"] and rank == 0:
            time.sleep(slow["s"])

    def timed() -> float:
        for x, y in data[:5]:
            strategy.run(step, args=(x, y))
        start, steps = time.perf_counter(), 0
        while True:
            for x, y in data:
                strategy.run(step, args=(x, y))
                steps += 1
            flag = strategy.reduce("MEAN", strategy.run(lambda: torch.tensor(float(time.perf_counter() - start
                                                                                      >= seconds))), axis=None)
            if float(flag) > 0:  # every process stops at the same step
                return steps / (time.perf_counter() - start)

    result = {"sync": timed() * k}
    if with_slow:
        slow["s"] = k / result["sync"]  # as long as a step takes: rank 0 becomes 2x slower
        result["sync_slow"] = timed() * k
        result["slow_sleep_s"] = slow["s"]
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def async_job(out: str, seconds: float) -> None:
    import phalanx as px
    from phalanx.coordinator import ClusterCoordinator

    strategy = px.ParameterServerStrategy()  # the servers serve here and exit
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def dataset_fn(ctx):
        import itertools

        return itertools.cycle(_batches(ctx.input_pipeline_id))

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(it, slow, n=1):
        for _ in range(n):
            x, y = next(it)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if slow and strategy.cluster_resolver.task_id == 0:
                time.sleep(slow)

    def timed(slow: float = 0.0, n: int = 1) -> float:
        coordinator.fetch([coordinator.schedule(step, args=(iterator, slow, n)) for _ in range(15)])
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            for _ in range(30):
                coordinator.schedule(step, args=(iterator, slow, n))
            coordinator.join()
            steps += 30 * n
        return steps / (time.perf_counter() - start)

    result = {"async_3": timed()}
    result["async_3_8_steps_per_function"] = timed(n=8)
    result["slow_sleep_s"] = 3 / result["async_3"]  # one step's duration on a worker: worker 0 becomes 2x slower
    result["async_slow_3"] = timed(result["slow_sleep_s"])
    for k in (2, 1):
        coordinator.workers[k].task.call("shutdown")  # fewer workers, same cluster
        result[f"async_{k}"] = timed()
    result["per_worker_completed"] = [w.completed for w in coordinator.workers]
    Path(out).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------- driver
def _run(cmd: list[str], timeout: float = 150) -> None:
    # One thread per process everywhere: workers of both kinds compute alike, and on a small host
    # several multi-threaded processes oversubscribe the cores (10x slower steps measured on 2 cores).
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {done.returncode}:\n{done.stdout[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:  # inside a launched job: job {sync|async} OUT SECONDS [slow]
        kind, out, seconds = argv[1], argv[2], float(argv[3])
        sync_job(out, seconds, argv[4:] == ["slow"]) if kind == "sync" else async_job(out, seconds)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="timed seconds per measurement")
    parser.add_argument("--out", default=str(HERE / "results" / "ps.json"))
    args = parser.parse_args(argv)

    started = time.time()
    s = str(args.seconds)
    worker = [sys.executable, "-m", "phalanx.cli", "run"]
    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in (1, 2, 3):
            out = f"{tmp}/sync_{k}.json"
            print(f"sync, {k} worker(s) ...", file=sys.stderr, flush=True)
            _run(worker + ["-n", str(k), "-m", "benchmarks.ps", "job", "sync", out, s] + (["slow"] if k == 3 else []))
            r = json.loads(Path(out).read_text())
            rows[f"sync_{k}"] = r["sync"]
            if k == 3:
                rows["sync_slow_3"] = r["sync_slow"]
                rows["sync_slow_sleep_s"] = r["slow_sleep_s"]
        out = f"{tmp}/async.json"
        print("async, 1 parameter server, 3 -> 2 -> 1 workers ...", file=sys.stderr, flush=True)
        _run(worker + ["--ps", "1", "--workers", "3", "-m", "benchmarks.ps", "job", "async", out, s])
        r = json.loads(Path(out).read_text())
        rows.update({k: v for k, v in r.items() if k.startswith("async_")})
        rows["async_slow_sleep_s"] = r["slow_sleep_s"]
    ratios = {
        "async_vs_sync_1": rows["async_1"] / rows["sync_1"],
        "async_vs_sync_2": rows["async_2"] / rows["sync_2"],
        "async_vs_sync_3": rows["async_3"] / rows["sync_3"],
        "async_vs_sync_with_2x_slow_worker": rows["async_slow_3"] / rows["sync_slow_3"],
        "sync_slowdown_from_2x_slow_worker": rows["sync_slow_3"] / rows["sync_3"],
        "async_slowdown_from_2x_slow_worker": rows["async_slow_3"] / rows["async_3"],
        "async_8_steps_per_function_vs_1": rows["async_3_8_steps_per_function"] / rows["async_3"],
        "async_scaling_2_over_1": rows["async_2"] / rows["async_1"],
        "async_scaling_3_over_1": rows["async_3"] / rows["async_1"],
        "sync_scaling_2_over_1": rows["sync_2"] / rows["sync_1"],
        "sync_scaling_3_over_1": rows["sync_3"] / rows["sync_1"],
    }
    result = {"machine": {"cpus": os.cpu_count()}, "started": time.ctime(started), "seconds_per_measurement":
              args.seconds, "batch_per_worker": BATCH, "model": f"MLP {IN}-{HIDDEN}-{HIDDEN}-{OUT}",
              "worker_steps_per_s": {k: v for k, v in rows.items() if not k.endswith("sleep_s")},
              "samples_per_s": {k: v * BATCH for k, v in rows.items() if not k.endswith("sleep_s")},
              "straggler_sleep_s": {"sync": rows["sync_slow_sleep_s"], "async": rows["async_slow_sleep_s"]},
              "ratios": ratios, "wall_s": time.time() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'configuration':<30}{'worker steps/s':>16}{'samples/s':>12}")
    for k, v in result["worker_steps_per_s"].items():
        print(f"{k:<30}{v:>16.1f}{v * BATCH:>12.0f}")
    for k, v in ratios.items():
        print(f"{k:<40}{v:>8.2f}")
    print(f"wrote {args.out} in {result['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
