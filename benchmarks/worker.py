"""One timed training job. Usage (from the repository root):

    python -m benchmarks.worker CONFIG MODEL OUT_JSON [--seconds S]

CONFIG: px_mirrored (self-launched 2 replicas) | px_mirrored_compiled (the step under
@phalanx.function, inductor) | px_mirrored_bf16 (bfloat16 autocast) | px_comm (self-launched 2
replicas that only all-reduce a buffer of the model's gradient size, with phalanx, each step) |
px_mwms | ddp | local2 | torch_comm (the gradient-sized all-reduce with torch.distributed's backend)
(launched by ``phalanx run -n 2``) | one_process (1 process, all cores) | px_one_device | raw
(1 process, 1 thread) | overhead_pair (px_one_device and raw in one process, alternating).
Each process trains on global batch 256 (its share of it) with Adam and writes steps/s.
``--device cuda`` puts replica k on GPU k (NCCL for the torch.distributed configs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch

from benchmarks.models import make_model, workload

GLOBAL_BATCH = 256  # the MLPs' and the small CNN's; a workload says its own (workload(name).global_batch)


def _gradient_numel(model_name: str) -> int:
    return sum(p.numel() for p in make_model(model_name).parameters())


class _Diag:
    """Per-replica diagnostics of one timed job, on with ``PHALANX_BENCH_DIAG=<directory>``.

    Each replica writes ``replica-<pid>.json``: its wall time, its CPU time (user/sys, every thread),
    voluntary/involuntary context switches, the time its threads were runnable but waited for a
    core (``/proc/<pid>/task/*/schedstat``), its session and autogroup (the unit the scheduler
    shares CPU among when autogroup is on), the CPUs its main thread was seen on (sampled every
    step, ``/proc/self/stat`` field 39) and its step times; a phalanx replica also its
    shared-memory waits (`phalanx.comm.wait_stats.record_wait_stats`). Off, it costs nothing.
    """

    def __init__(self) -> None:
        self.dir = os.environ.get("PHALANX_BENCH_DIAG")
        self.steps: list[float] = []
        self.cpus: list[int] = []

    def wrap(self, step):
        if not self.dir:
            return step

        def timed(x, y):
            t = time.perf_counter()
            step(x, y)
            self.steps.append(time.perf_counter() - t)
            with open("/proc/self/stat") as f:
                cpu = int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, after "pid (comm)"
            self.cpus.append(cpu)

        return timed

    def start(self) -> None:
        if self.dir:
            self.steps.clear()
            self.cpus.clear()
            self.t0, self.r0, self.s0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), _schedstat()
            self.m0 = _main_schedstat()

    def write(self, kind: str, rank: int) -> None:
        if not self.dir:
            return
        r1, s1, m1 = resource.getrusage(resource.RUSAGE_SELF), _schedstat(), _main_schedstat()
        try:
            with open("/proc/self/autogroup") as f:
                autogroup = f.read().split()[0]
        except OSError:
            autogroup = None
        steps = sorted(self.steps)
        out = {
            "config": kind,
            "rank": rank,
            "pid": os.getpid(),
            "sid": os.getsid(0),
            "autogroup": autogroup,
            "wall_s": time.perf_counter() - self.t0,
            "user_s": r1.ru_utime - self.r0.ru_utime,
            "sys_s": r1.ru_stime - self.r0.ru_stime,
            "nvcsw": r1.ru_nvcsw - self.r0.ru_nvcsw,
            "nivcsw": r1.ru_nivcsw - self.r0.ru_nivcsw,
            "run_s": (s1[0] - self.s0[0]) / 1e9,
            "runqueue_wait_s": (s1[1] - self.s0[1]) / 1e9,
            "main_run_s": (m1[0] - self.m0[0]) / 1e9,  # the training thread alone
            "main_runqueue_s": (m1[1] - self.m0[1]) / 1e9,
            "cpus": {str(c): self.cpus.count(c) for c in sorted(set(self.cpus))},
            "cpu_per_step": self.cpus,
            "steps": len(steps),
            "step_median_ms": steps[len(steps) // 2] * 1e3 if steps else None,
            "step_p90_ms": steps[int(len(steps) * 0.9)] * 1e3 if steps else None,
            "step_max_ms": steps[-1] * 1e3 if steps else None,
            "step_times_ms": [round(t * 1e3, 3) for t in self.steps],
        }
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, f"replica-{os.getpid()}.json"), "w") as f:
            json.dump(out, f)


def _main_schedstat() -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of the main thread."""
    with open("/proc/self/schedstat") as f:
        a, b, _ = f.read().split()
    return int(a), int(b)


def _schedstat() -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one), summed over this process's threads."""
    run = wait = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                a, b, _ = f.read().split()
        except (OSError, ValueError):
            continue
        run, wait = run + int(a), wait + int(b)
    return run, wait


DIAG = _Diag()


def _timed(step, data, seconds: float, sync=lambda: None, any_done=lambda done: done) -> tuple[int, float]:
    """Steps over ``data`` until ``seconds`` have passed; ``any_done`` makes every process stop at the same pass."""
    for x, y in data[:5]:  # warm-up
        step(x, y)
    sync()
    step = DIAG.wrap(step)
    DIAG.start()
    start, steps = time.perf_counter(), 0
    while True:
        for x, y in data:
            step(x, y)
            steps += 1
        sync()  # every process stops together, so the slowest one decides
        elapsed = time.perf_counter() - start
        if any_done(elapsed >= seconds):  # one decision for all: a process alone in a pass would hang
            return steps, elapsed


def run_phalanx(kind: str, model_name: str, seconds: float, device: str = "cpu") -> dict:
    import phalanx as px

    if DIAG.dir:  # every replica runs this before its strategy builds the shared-memory all-reduce
        from phalanx.comm.wait_stats import record_wait_stats

        record_wait_stats(DIAG.dir)

    if kind == "px_mirrored_nccl":  # under phalanx run -n <GPUs>; one GPU: NCCL at world size 1
        os.environ["PHALANX_SINGLE_REPLICA_COLLECTIVES"] = "1"
        strategy = px.MirroredStrategy()
    elif kind.startswith("px_mirrored") or kind == "px_comm":
        gpus = torch.cuda.device_count()
        strategy = px.MirroredStrategy([f"cuda:{i}" for i in range(gpus)] if device == "cuda" else ["cpu:0", "cpu:1"])
    elif kind == "px_mwms":
        strategy = px.MultiWorkerMirroredStrategy()
    elif device == "cuda":
        strategy = px.OneDeviceStrategy("cuda:0")
    else:
        torch.set_num_threads(1)
        strategy = px.OneDeviceStrategy("cpu")
    here = torch.device(device, strategy.extended.process_index) if device == "cuda" else torch.device("cpu")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
        if strategy.num_replicas_in_sync > 1:
            strategy.extended.barrier()

    def any_done(done: bool) -> bool:
        flag = torch.tensor([float(done)], device=here)
        return bool(strategy.extended.all_reduce([flag])[0].item() > 0)

    if kind == "px_comm":  # communication alone: what backward would hide if overlap were perfect
        grads = torch.ones(_gradient_numel(model_name), device=here)
        step = lambda x, y: strategy.extended.all_reduce([grads])  # noqa: E731
        steps, elapsed = _timed(step, [(None, None)] * 20, seconds, sync, any_done)
        return {"rank": strategy.extended.process_index, "steps": steps, "seconds": elapsed}
    w = workload(model_name)
    torch.manual_seed(0)
    with strategy.scope():
        model = w.make().to(here)
        opt = w.make_optimizer(model.parameters())

    autocast = torch.autocast(device, dtype=torch.bfloat16) if kind.endswith("_bf16") else w.autocast(here.type)

    def train_step(x, y):
        with autocast:
            out = model(x)
        loss = px.nn.compute_average_loss(w.per_example_loss(out, y), global_batch_size=w.global_batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    data = list(strategy.experimental_distribute_dataset(w.batches(w.global_batch, 20)))

    def step(x, y):
        strategy.run(train_step, args=(x, y))

    if kind.endswith("_compiled"):
        step = px.function(step)  # TF's @tf.function idiom; the warm-up steps compile

    steps, elapsed = _timed(step, [(b[0], b[1]) for b in data], seconds, sync, any_done)
    DIAG.write(kind, strategy.extended.process_index)
    return {"rank": strategy.extended.process_index, "steps": steps, "seconds": elapsed, "global_batch": w.global_batch}


def run_torch(kind: str, model_name: str, seconds: float, device: str = "cpu") -> dict:
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ.get("PHALANX_RANK", 0)), int(os.environ.get("PHALANX_WORLD_SIZE", 1))
    here = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(here)
    elif kind in ("ddp", "local2", "raw", "torch_comm"):
        torch.set_num_threads(1)
    if world > 1 or kind == "ddp":  # DDP needs its group at world size 1 too (and all-reduces through it)
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://{os.environ['PHALANX_MASTER_ADDR']}:{os.environ['PHALANX_MASTER_PORT']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    def any_done(done: bool) -> bool:
        if world == 1:
            return done
        flag = torch.tensor([float(done)], device=here)
        dist.all_reduce(flag)
        return bool(flag.item() > 0)

    if kind == "torch_comm":  # communication alone, as px_comm
        grads = torch.ones(_gradient_numel(model_name), device=here)
        steps, elapsed = _timed(lambda x, y: dist.all_reduce(grads), [(None, None)] * 20, seconds, sync, any_done)
        dist.destroy_process_group()
        return {"rank": rank, "steps": steps, "seconds": elapsed}
    w = workload(model_name)
    torch.manual_seed(0)
    model = w.make().to(here)
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[here.index] if device == "cuda" else None)
    opt = w.make_optimizer(model.parameters())
    local_batch = w.global_batch // world

    def step(x, y):
        with w.autocast(here.type):
            out = model(x)
        loss = w.per_example_loss(out, y).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    data = [
        (
            x[rank * local_batch : (rank + 1) * local_batch].to(here),
            y[rank * local_batch : (rank + 1) * local_batch].to(here),
        )
        for x, y in w.batches(w.global_batch, 20)
    ]
    steps, elapsed = _timed(step, data, seconds, sync, any_done)
    DIAG.write(kind, rank)
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"rank": rank, "steps": steps, "seconds": elapsed, "global_batch": w.global_batch}


def run_overhead_pair(model_name: str, seconds: float, device: str = "cpu") -> dict:
    """OneDeviceStrategy against the raw loop in one process, one thread, alternating passes.

    On a GPU (``device="cuda"``) also MirroredStrategy of one GPU, and each pass ends when the GPU
    has finished it.

    Separate processes differ by +-5 % on this VM (core, memory placement, neighbours), far more
    than the ~10 us a ``strategy.run`` adds to a step; alternating passes over the same batches in
    one process pairs every phalanx pass with a raw pass taken under the same conditions. Both
    sides run the same step function (mean loss): the strategy's cost is what is measured, not
    the choice of loss (``compute_average_loss``'s sum and divide add two small autograd nodes).
    """
    import phalanx as px

    cuda = device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    here = torch.device("cuda:0" if cuda else "cpu")
    w = workload(model_name)
    strategy = px.OneDeviceStrategy(str(here))
    torch.manual_seed(0)
    with strategy.scope():
        px_model = w.make()
    torch.manual_seed(0)
    raw_model = w.make().to(here)
    px_opt = w.make_optimizer(px_model.parameters())
    raw_opt = w.make_optimizer(raw_model.parameters())

    def train_step(model, opt, x, y):  # the same user code on both sides: only the strategy differs
        with w.autocast(here.type):
            out = model(x)
        loss = w.per_example_loss(out, y).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def px_step(x, y):
        strategy.run(train_step, args=(px_model, px_opt, x, y))

    def raw_step(x, y):
        train_step(raw_model, raw_opt, x, y)

    raw_data = [(x.to(here), y.to(here)) for x, y in w.batches(w.global_batch, 20)]
    px_data = [(b[0], b[1]) for b in strategy.experimental_distribute_dataset(w.batches(w.global_batch, 20))]
    runs = {"px_one_device": (px_step, px_data), "raw": (raw_step, raw_data)}
    if cuda:
        mirrored = px.MirroredStrategy(["cuda:0"])
        torch.manual_seed(0)
        with mirrored.scope():
            m_model = w.make()
        m_opt = w.make_optimizer(m_model.parameters())
        m_data = [(b[0], b[1]) for b in mirrored.experimental_distribute_dataset(w.batches(w.global_batch, 20))]
        runs["px_mirrored"] = (lambda x, y: mirrored.run(train_step, args=(m_model, m_opt, x, y)), m_data)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for step, data in runs.values():  # warm-up
        for x, y in data[:5]:
            step(x, y)
    sync()
    spent, steps, order = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0), list(runs)
    while sum(spent.values()) < len(runs) * seconds:
        order.reverse()  # no side always runs first (or last)
        for name in order:
            step, data = runs[name]
            start = time.perf_counter()
            for x, y in data:
                step(x, y)
            sync()
            spent[name] += time.perf_counter() - start
            steps[name] += len(data)
    return {"rank": 0, **{name: steps[name] * w.global_batch / spent[name] for name in runs}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.config == "overhead_pair":
        result = run_overhead_pair(args.model, args.seconds, args.device)
    else:
        run = run_phalanx if args.config.startswith("px_") else run_torch
        result = run(args.config, args.model, args.seconds, args.device)
        result["samples_per_s"] = result["steps"] * result.pop("global_batch", GLOBAL_BATCH) / result["seconds"]
    if result["rank"] == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
