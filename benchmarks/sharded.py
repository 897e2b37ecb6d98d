"""``python -m benchmarks.sharded``: FullyShardedStrategy's memory and step time (issue 32).

Three measurements, each on real multi-process CPU jobs (gloo), every job launched by
``phalanx run -n N`` so that all configurations run on the same kind of processes:

1. **Memory**, per replica: the bytes of parameters + gradients + optimizer state it holds (the
   local part of each shard; taken after backward, before the optimizer step and ``zero_grad``, at
   the second step, once Adam's state exists), under phalanx ``FullyShardedStrategy``, phalanx
   ``MirroredStrategy`` and plain FSDP2 (torch's ``fully_shard`` applied as phalanx does: each
   Linear holding at least ``min_params`` elements, then the root). Target: sharded / mirrored
   <= 1.1 / N. Peak RSS (``ru_maxrss``) of each replica is recorded for information: it also
   counts torch itself, activations, communication buffers, and the whole model every replica
   builds before it is sharded.
2. **Step time** (samples/s) of the same jobs: sharded against plain FSDP2 (target >= 0.95x) and
   against Mirrored, in interleaved rounds (the configurations' order shuffled in every round);
   each ratio is the median of per-round paired ratios, with every round listed.
3. **Out of memory** (``--oom``): a 4-replica job (an MLP of 16 Linear layers, 240 MiB) whose
   replicas each limit their address space (``RLIMIT_AS``, as ``ulimit -v``) to what they use
   once started (after one step of a tiny model) plus a budget of 4 P, P the model's parameter
   bytes: the size of its whole Adam training state (parameters, gradients, two moments), which
   Mirrored needs plus its buffers, while a sharded replica needs 1/4 of it plus, once, the whole
   model it builds before sharding (peak about 2 P). The sharded job (and plain FSDP2, for
   reference) trains 3 steps (status 0); the Mirrored job fails with torch's out-of-memory error,
   which names the allocation (Adam's state). glibc is told to return freed blocks to the system
   (``MALLOC_ENV``): with its default, freed gathered layers stay in the process (see there).

N = 2 and N = 4 replicas; on a 2-core machine 4 CPU replicas share the cores (the report says so).
The model is an MLP 1024-4096-4096-1024 (about 96 MiB of float32 parameters), Adam, global batch
64. ``--quick``: a small MLP, few steps, one round, a small out-of-memory job; a smoke run whose
figures are not to be quoted.

Examples::

    python -m benchmarks.sharded --quick         # about a minute on 2 cores
    python -m benchmarks.sharded --out benchmarks/results/sharded.json   # 3 rounds: about 9 minutes
    python -m benchmarks.sharded --oom           # only the out-of-memory demonstration: about 75 s

One job: ``phalanx run -n N benchmarks/sharded.py --worker KIND ...`` (KIND: sharded, mirrored,
fsdp2); each replica writes ``<out>/<KIND>-<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

KINDS = ("sharded", "fsdp2", "mirrored")
GLOBAL_BATCH = 64
# name -> (layer widths, min_params): every Linear holds at least min_params elements, so each is
# a sharding group of its own under both phalanx and plain FSDP2.
MODELS = {
    "mlp_96mib": ((1024, 4096, 4096, 1024), 1 << 20),  # 25.2 M parameters: 96 MiB of float32
    "mlp_quick": ((256, 1024, 1024, 256), 1 << 16),
    # The out-of-memory model: 16 Linear layers of about 4 M elements (256 MiB), so that the
    # largest group FSDP2 gathers at once is small beside the whole.
    "mlp_oom": ((1024, *([2048] * 15), 1024), 1 << 20),
    "mlp_oom_quick": ((256, *([512] * 15), 256), 1 << 16),
}
# The address space each out-of-memory replica may add to what it holds once started, in units
# of the model's parameter bytes P. Mirrored needs 4 P (parameters, gradients, Adam's two
# moments) plus its gradient buckets; the sharded replica about P (the whole model it builds
# before sharding) + 4 P / 4 + two gathered layers, and Adam's state after the first step has
# released the whole model.
OOM_BUDGET_P = 4.0
# glibc settings of the out-of-memory jobs. Its default mmap threshold grows to the size of the
# largest block freed (up to 32 MiB), after which FSDP2's gathered layers (freed after each use)
# come from the heap and stay in the process: plain FSDP2 and FullyShardedStrategy alike then
# hold 5-6 P of address space and resident memory after a step instead of about 2.5 P and 1 P.
# A fixed threshold returns every block of 128 KiB or more to the system when freed. One arena:
# each thread's arena reserves 64 MiB of address space.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "1"}
OOM_REPLICAS = 4
JOB_TIMEOUT_S = 600.0
# A traceback's frame: file (its last two parts), line, function, code (--tee prefixes "[replica k]").
FRAME = re.compile(r'File "[^"]*?([^"/]+/[^"/]+)", line (\d+), in (\S+)\n(?:\[replica \d+\])?\s*(.+)')
OOM_ERROR = re.compile(r"[^\n]*(?:can't allocate memory|Cannot allocate memory|MemoryError|out of memory)[^\n]*")


# ---------------------------------------------------------------- one replica (under phalanx run)
def make_model(widths: tuple[int, ...]):
    import torch

    layers: list = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def local_bytes(model, opt) -> dict:
    """Bytes this replica holds of parameters, gradients and optimizer state (shards: their local
    part). ``tests/scripts/sharded.py`` asserts the issue's memory target with this same count."""
    import torch

    def size(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(size(p) for p in model.parameters())
    grads = sum(size(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(size(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


def vm_kib(field: str = "VmSize") -> int:
    """This process's ``field`` of /proc/self/status (VmSize: address space now; VmPeak: its peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _limit_address_space(budget_bytes: int) -> dict:
    """RLIMIT_AS = the address space used now + ``budget_bytes`` (``ulimit -v`` from here on).

    Called once the replica has taken one step of a tiny model with the same machinery: torch's
    lazy imports (the optimizer's first use imports torch._dynamo and sympy), threads and
    communication buffers are then in place, and the budget is left to the model itself.
    """
    now = vm_kib() * 1024
    resource.setrlimit(resource.RLIMIT_AS, (now + budget_bytes, now + budget_bytes))
    return {"baseline_vm_bytes": now, "limit_bytes": now + budget_bytes}


def run_worker(kind: str, model_name: str, out: str, warmup: int, steps: int, budget_bytes: int) -> None:
    """One replica of a ``phalanx run -n N`` job: trains ``warmup + steps`` steps, writes its figures."""
    import torch

    widths, min_params = MODELS[model_name]
    rank, world = int(os.environ["PHALANX_RANK"]), int(os.environ["PHALANX_WORLD_SIZE"])
    batches = _batches(widths, warmup + steps)
    limit: dict = {}
    if kind == "fsdp2":
        import datetime

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if "OMP_NUM_THREADS" not in os.environ:  # each replica its share of the cores, as phalanx does
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ['PHALANX_MASTER_ADDR']}:{os.environ['PHALANX_MASTER_PORT']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
        mesh = init_device_mesh("cpu", (world,))
        if budget_bytes:

            def tiny_step():
                tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
                fully_shard(tiny[0], mesh=mesh)
                fully_shard(tiny, mesh=mesh)
                tiny_opt = torch.optim.Adam(tiny.parameters())
                tiny(torch.ones(2, 8)).sum().backward()
                tiny_opt.step()

            tiny_step()
            limit = _limit_address_space(budget_bytes)
        torch.manual_seed(0)
        model = make_model(widths)
        for sub in list(model.modules())[1:]:
            if sum(p.numel() for p in sub.parameters(recurse=False)) >= min_params:
                fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        local = GLOBAL_BATCH // world

        def step(x, y, measure):
            loss = torch.nn.functional.cross_entropy(model(x), y)  # FSDP2 averages over replicas
            loss.backward()
            figures = local_bytes(model, opt) if measure else None
            opt.step()
            opt.zero_grad(set_to_none=True)
            return figures

        data = [(x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]) for x, y in batches]
        run_step, sync, close = step, dist.barrier, dist.destroy_process_group
    else:
        import phalanx as px

        strategy = (
            px.FullyShardedStrategy(min_params_to_shard=min_params) if kind == "sharded" else px.MirroredStrategy()
        )
        if budget_bytes:
            with strategy.scope():
                tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
                tiny_opt = torch.optim.Adam(tiny.parameters())

            def tiny_step():
                tiny(torch.ones(2, 8)).sum().backward()
                tiny_opt.step()

            strategy.run(tiny_step)
            limit = _limit_address_space(budget_bytes)
        torch.manual_seed(0)
        with strategy.scope():
            model = make_model(widths)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        figures_box: list = []

        def replica_step(x, y, measure):
            per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            loss = px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            loss.backward()
            if measure:
                figures_box.append(local_bytes(model, opt))
            opt.step()
            opt.zero_grad(set_to_none=True)

        def run_step(x, y, measure):
            strategy.run(replica_step, args=(x, y, measure))
            return figures_box.pop() if measure else None

        data = [(b[0], b[1]) for b in strategy.experimental_distribute_dataset(batches)]
        sync, close = strategy.extended.barrier, strategy.close
    memory = None
    for i, (x, y) in enumerate(data[:warmup]):
        figures = run_step(x, y, measure=i == 1)  # the second step: Adam's state exists
        memory = figures or memory
    sync()
    start = time.perf_counter()
    for x, y in data[warmup:]:
        run_step(x, y, measure=False)
    sync()  # every replica has finished: the slowest decides
    elapsed = time.perf_counter() - start
    close()
    result = {
        "kind": kind,
        "rank": rank,
        "replicas": world,
        "memory": memory,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_vm_bytes": vm_kib("VmPeak") * 1024,
        "steps": steps,
        "seconds": elapsed,
        "samples_per_s": steps * GLOBAL_BATCH / elapsed if steps else None,
        "threads": torch.get_num_threads(),
        **limit,
    }
    Path(out, f"{kind}-{rank}.json").write_text(json.dumps(result))


def _batches(widths: tuple[int, ...], count: int) -> list:
    import torch

    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(GLOBAL_BATCH, widths[0], generator=g), torch.randint(0, widths[-1], (GLOBAL_BATCH,), generator=g))
        for _ in range(count)
    ]


def param_bytes(model_name: str) -> int:
    widths, _ = MODELS[model_name]
    return 4 * sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


# ---------------------------------------------------------------- the driver
def _job(
    kind: str, n: int, model: str, out: str, warmup: int, steps: int, budget: int = 0, timeout: float = JOB_TIMEOUT_S
):
    """Runs one ``phalanx run -n n`` job in a session of its own (killed whole on timeout).

    Returns (exit status, combined output, seconds); status -9 after a timeout.
    """
    # The script's path, not ``-m benchmarks.sharded``: phalanx run parses the options that follow
    # ``-m MODULE`` as its own (``--worker`` would abbreviate its ``--workers``); a script's path
    # ends its options.
    cmd = [sys.executable, "-m", "phalanx.cli", "run", "-n", str(n), "--tee", str(HERE / "sharded.py")]
    cmd += ["--worker", kind, "--model", model, "--job-out", out, "--warmup", str(warmup), "--steps", str(steps)]
    cmd += ["--budget-bytes", str(budget)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["PHALANX_LOG_ROOT"] = os.path.join(out, "logs")
    env.pop("OMP_NUM_THREADS", None)  # each replica its share of the cores
    if budget:
        env.update(MALLOC_ENV)
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
        try:  # the launcher's replicas end with it; anything left of the session goes now
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.seek(0)
        output = log.read().decode(errors="replace")
    return rc, output, time.monotonic() - start


def _read(out: str, kind: str, n: int) -> list[dict]:
    return [json.loads(Path(out, f"{kind}-{r}.json").read_text()) for r in range(n)]


def _ratio(a: list[float], b: list[float]) -> dict:
    ratios = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}


def measure(replicas: list[int], model: str, rounds: int, warmup: int, steps: int) -> dict:
    """Memory and samples/s of every configuration, N by N, the configurations shuffled per round."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in replicas:
            rows = {k: {"samples_per_s": [], "memory": [], "peak_rss_bytes": []} for k in KINDS}
            for r in range(rounds):
                order = list(KINDS)
                random.Random(r * 7 + n).shuffle(order)
                for kind in order:
                    out = os.path.join(tmp, f"{kind}-{n}-{r}")
                    os.makedirs(out)
                    rc, output, seconds = _job(kind, n, model, out, warmup, steps)
                    if rc != 0:
                        raise RuntimeError(f"{kind} on {n} replicas failed (status {rc}):\n{output[-4000:]}")
                    per_rank = _read(out, kind, n)
                    value = per_rank[0]["samples_per_s"]
                    rows[kind]["samples_per_s"].append(value)
                    rows[kind]["memory"].append(max((p["memory"] for p in per_rank), key=lambda m: m["total"]))
                    rows[kind]["peak_rss_bytes"].append(max(p["peak_rss_bytes"] for p in per_rank))
                    mib = rows[kind]["memory"][-1]["total"] / 2**20
                    print(
                        f"  N={n} round {r + 1}/{rounds} {kind:<9} {value:>8.1f} samples/s  "
                        f"params+grads+optimizer {mib:>7.1f} MiB/replica  (job {seconds:.0f} s)",
                        flush=True,
                    )
            mem = {k: rows[k]["memory"][0] for k in KINDS}  # the same every round (checked below)
            for k in KINDS:
                if any(m != mem[k] for m in rows[k]["memory"]):
                    raise RuntimeError(f"{k} on {n} replicas held different bytes in different rounds: {rows[k]}")
            target = 1.1 / n
            report[str(n)] = {
                "replicas": n,
                "oversubscribed": n > cores,
                "memory_bytes_per_replica": mem,
                "peak_rss_bytes_per_replica": {k: max(rows[k]["peak_rss_bytes"]) for k in KINDS},
                "memory_sharded_vs_mirrored": mem["sharded"]["total"] / mem["mirrored"]["total"],
                "memory_fsdp2_vs_mirrored": mem["fsdp2"]["total"] / mem["mirrored"]["total"],
                "memory_target": target,
                "memory_target_met": mem["sharded"]["total"] / mem["mirrored"]["total"] <= target,
                "samples_per_s": {k: rows[k]["samples_per_s"] for k in KINDS},
                "sharded_vs_fsdp2": _ratio(rows["sharded"]["samples_per_s"], rows["fsdp2"]["samples_per_s"]),
                "sharded_vs_mirrored": _ratio(rows["sharded"]["samples_per_s"], rows["mirrored"]["samples_per_s"]),
                "step_target": 0.95,
            }
            report[str(n)]["step_target_met"] = report[str(n)]["sharded_vs_fsdp2"]["median"] >= 0.95
    return report


def oom(model: str, steps: int) -> dict:
    """The out-of-memory demonstration: sharded and Mirrored on 4 replicas under the same RLIMIT_AS."""
    p = param_bytes(model)
    budget = int(OOM_BUDGET_P * p)
    result: dict = {
        "model": model,
        "replicas": OOM_REPLICAS,
        "param_bytes": p,
        "adam_training_state_bytes": 4 * p,  # parameters, gradients and two moments
        "budget_bytes_over_baseline": budget,
        "limit": "RLIMIT_AS (ulimit -v) = address space once started + budget, set in each replica",
        "malloc_env": MALLOC_ENV,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("sharded", "fsdp2", "mirrored"):  # plain FSDP2 for reference
            out = os.path.join(tmp, kind)
            os.makedirs(out)
            rc, output, seconds = _job(kind, OOM_REPLICAS, model, out, warmup=steps, steps=0, budget=budget)
            error = OOM_ERROR.search(output)
            row = {"status": rc, "seconds": seconds, "error": error.group(0).strip() if error else None}
            if error:  # the innermost frame of the traceback that ends in the error: the allocation
                frames = FRAME.findall(output[: error.start()])
                row["where"] = "{}:{} in {}: {}".format(*frames[-1]) if frames else None
            if rc == 0:
                per_rank = _read(out, kind, OOM_REPLICAS)
                row["steps"] = steps
                row["peak_vm_over_baseline_bytes"] = max(q["peak_vm_bytes"] - q["baseline_vm_bytes"] for q in per_rank)
                row["memory_bytes_per_replica"] = max((q["memory"] for q in per_rank), key=lambda m: m["total"])
            else:
                row["output_tail"] = output[-3000:]
            result[kind] = row
            shown = row["error"] or (f"{steps} steps" if rc == 0 else "no out-of-memory message")
            print(f"  oom {kind:<9} status {rc:>3}  ({seconds:.0f} s)  {shown}", flush=True)
    result["demonstrated"] = result["sharded"]["status"] == 0 and (
        result["mirrored"]["status"] != 0 and result["mirrored"]["error"] is not None
    )
    return result


def machine() -> dict:
    from benchmarks.__main__ import machine as describe

    return describe()


def summary(report: dict) -> str:
    lines = ["", "FullyShardedStrategy (issue 32):"]
    fmt = lambda r: f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]"  # noqa: E731
    for n, row in report.get("measure", {}).items():
        note = " (more replicas than cores: they share them)" if row["oversubscribed"] else ""
        mem = row["memory_bytes_per_replica"]
        lines.append(f"  N={n}{note}")
        lines.append(
            "    params+grads+optimizer per replica: "
            + ", ".join(f"{k} {mem[k]['total'] / 2**20:.1f} MiB" for k in KINDS)
            + f"; sharded/mirrored {row['memory_sharded_vs_mirrored']:.3f} "
            f"(target <= {row['memory_target']:.3f}: {'met' if row['memory_target_met'] else 'NOT met'})"
        )
        rss = row["peak_rss_bytes_per_replica"]
        lines.append("    peak RSS per replica: " + ", ".join(f"{k} {rss[k] / 2**20:.0f} MiB" for k in KINDS))
        lines.append(
            f"    samples/s sharded/fsdp2 {fmt(row['sharded_vs_fsdp2'])} "
            f"(target >= 0.95: {'met' if row['step_target_met'] else 'NOT met'}); "
            f"sharded/mirrored {fmt(row['sharded_vs_mirrored'])}"
        )
    if "oom" in report:
        o = report["oom"]
        lines.append(
            f"  out of memory, {o['replicas']} replicas, +{o['budget_bytes_over_baseline'] / 2**20:.0f} MiB address "
            f"space each (Adam training state {o['adam_training_state_bytes'] / 2**20:.0f} MiB): "
            f"sharded status {o['sharded']['status']}, plain FSDP2 status {o['fsdp2']['status']}, "
            f"mirrored status {o['mirrored']['status']} "
            f"({o['mirrored']['error']}): {'demonstrated' if o['demonstrated'] else 'NOT demonstrated'}"
        )
        if o["mirrored"].get("where"):
            lines.append(f"    mirrored's failing allocation: {o['mirrored']['where']}")
    lines.append(f"elapsed: {report['elapsed_s']:.0f} s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sharded",
        description="FullyShardedStrategy against MirroredStrategy and plain FSDP2: memory per replica, "
        "step time, and a model that only the sharded strategy can train under a memory limit.",
        epilog=__doc__[__doc__.index("Examples::") :].replace("::", ":"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a small model, few steps, one round: a smoke run")
    parser.add_argument(
        "--rounds", type=_positive, default=None, help="interleaved rounds (default: 3; 1 with --quick)"
    )
    parser.add_argument(
        "--replicas",
        type=_replica_counts,
        default=[2, 4],
        help="comma list of replica counts, each at least 2 (default: 2,4)",
    )
    parser.add_argument("--oom", action="store_true", help="only the out-of-memory demonstration")
    parser.add_argument("--skip-oom", action="store_true", help="no out-of-memory demonstration")
    parser.add_argument(
        "--out", type=Path, default=None, help="the JSON report (default: sharded-<timestamp>.json in the temp dir)"
    )
    # One replica of a job (what the driver starts under phalanx run):
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=tuple(MODELS), default="mlp_96mib", help=argparse.SUPPRESS)
    parser.add_argument("--job-out", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; received {text!r}")
    return int(text)


def _replica_counts(text: str) -> list[int]:
    counts = text.split(",")
    if not all(c.isdigit() and int(c) >= 2 for c in counts):
        raise argparse.ArgumentTypeError(f"must be a comma list of integers >= 2; received {text!r}")
    return [int(c) for c in counts]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.oom and args.skip_oom:
        parser.error("--oom (only the out-of-memory demonstration) and --skip-oom exclude each other")
    if args.worker:
        run_worker(args.worker, args.model, args.job_out, args.warmup, args.steps, args.budget_bytes)
        return 0
    rounds = args.rounds or (1 if args.quick else 3)
    replicas = args.replicas
    out = args.out or Path(tempfile.gettempdir()) / f"sharded-{time.strftime('%Y%m%d-%H%M%S')}.json"
    model = "mlp_quick" if args.quick else "mlp_96mib"
    report: dict = {
        "machine": machine(),
        "started": time.ctime(),
        "quick": args.quick,
        "rounds": rounds,
        "model": model,
        "param_bytes": param_bytes(model),
        "global_batch": GLOBAL_BATCH,
        "optimizer": "Adam",
        "backend": "gloo (CPU processes, phalanx run -n N)",
    }
    start = time.monotonic()
    if not args.oom:
        print(f"memory and step time ({model}, {rounds} round(s)):", flush=True)
        warmup, steps = (3, 4) if args.quick else (3, 10)
        report["measure"] = measure(replicas, model, rounds, warmup, steps)
    if not args.skip_oom:
        print("out of memory:", flush=True)
        report["oom"] = oom("mlp_oom_quick" if args.quick else "mlp_oom", steps=3)
    report["elapsed_s"] = time.monotonic() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(summary(report))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
