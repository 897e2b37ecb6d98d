"""Asynchronous parameter-server training vs synchronous all-reduce, with 1-3 workers and a straggler.

    python -m benchmarks.ps [--seconds 4] [--out benchmarks/results/ps.json]
    python -m benchmarks.ps --wire [--mb 1] [--rounds 7]     # cost of signing every byte, and of TLS

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
import random
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
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )


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
            flag = strategy.reduce(
                "MEAN", strategy.run(lambda: torch.tensor(float(time.perf_counter() - start >= seconds))), axis=None
            )
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


# ------------------------------------------------------------------------------------------- the wire
# ``--wire``: what signing every byte, and TLS, cost a parameter-server step. A step is what a
# worker does per optimizer step: read the variables (MB megabytes back) and send their gradients
# (MB megabytes out; the server applies SGD). Three servers (separate processes) are started at
# once and measured in interleaved rounds from this process:
#   signed     every byte signed (the default: HMAC-SHA256 head + AES-GMAC over the body)
#   head_only  the body's GMAC replaced by a constant (what the wire signed before: only the
#              header; a benchmark-only switch, in both processes)
#   tls        signed, over mutual TLS (throwaway certificates)
# The configurations' steps alternate (in a random order), so all see the same load on a busy host;
# each figure is the median of per-round ratios (steps/s over steps/s of the same round), also
# in CPU seconds per step (client + server) and from the median step duration. ``tag_us_per_mib``
# is the CPU the body tag adds to signing and verifying one MiB in this process (no transport). A step includes the
# worker's forward and backward pass on an MLP of that size (batch 64); ``--no-compute`` leaves it
# out, which gives the wire's share of a step without any model: an upper bound.
WIRE_CONFIGS = ("signed", "head_only", "tls")


class _NoBodyMac:
    """Stands in for the body's GMAC in the ``head_only`` configuration (benchmark only)."""

    def __init__(self, key: bytes, nonce: bytes, length: int) -> None:
        pass

    def update(self, piece) -> None:
        pass

    def finalize(self) -> bytes:
        return bytes(16)

    def of(self, body) -> bytes:
        return bytes(16)


_BODY_MAC = None


def _wire_mode(mode: str) -> None:
    global _BODY_MAC
    from phalanx.ps import wire

    if _BODY_MAC is None:
        _BODY_MAC = wire._BodyMac
    wire._BodyMac = _NoBodyMac if mode == "head_only" else _BODY_MAC


def wire_server(address: str, mode: str) -> None:
    import threading

    from phalanx.ps.transport import GrpcTransport
    from phalanx.ps.variable_server import ParameterServerService

    _wire_mode(mode)
    stop = threading.Event()
    service = ParameterServerService(0, os.environ["PHALANX_CLUSTER_SECRET"].encode(), on_shutdown=stop.set)
    server = GrpcTransport().serve(address, service)  # TLS when PHALANX_TLS_* are set
    stop.wait(600)
    server.stop(1.0)


def wire_tag_cost(mb: float, reps: int = 300) -> dict:
    """CPU microseconds (this thread's) to sign, cut into chunks and verify a frame of ``mb`` MB.

    With and without the body tag, alternating; the difference is what signing every byte adds
    per frame, free of the scheduling noise of a busy host (thread CPU time, not wall time).
    """
    import statistics

    from phalanx.ps import wire

    grad = torch.randn(int(mb * (1 << 20) / 4))
    secret = b"bench-secret-0123456789abcdef"
    signer, verifier = wire.Signer(secret, "chief:0"), wire.Verifier(secret, wire.ReplayGuard())
    took: dict[str, list[float]] = {"signed": [], "head_only": []}
    for i in range(reps + 10):
        for mode in ("signed", "head_only") if i % 2 else ("head_only", "signed"):
            _wire_mode(mode)
            t0 = time.thread_time()
            frame = signer.encode("apply", {"keys": ["w"]}, [grad])
            verifier.decode("apply", list(frame.chunks()))
            if i >= 10:
                took[mode].append((time.thread_time() - t0) * 1e6)
    _wire_mode("signed")
    return {
        "frame_mb": mb,
        "sign_and_verify_us_median": {m: statistics.median(v) for m, v in took.items()},
        "tag_us_per_mib": statistics.median(a - b for a, b in zip(took["signed"], took["head_only"])) / mb,
    }


def wire_bench(mb: float, rounds: int, seconds: float, compute: bool = True) -> dict:
    import statistics

    from phalanx.launch.env import free_port
    from phalanx.ps.client import RemoteTask
    from phalanx.ps.tls import TlsConfig, generate_local
    from phalanx.ps.transport import GrpcTransport

    secret = "bench-secret-0123456789abcdef"
    n = int(mb * (1 << 20) / 4)
    torch.set_num_threads(1)  # as the servers (OMP_NUM_THREADS=1): on a small host threads oversubscribe
    procs, tasks = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tls_env = generate_local(tmp)
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "PHALANX_CLUSTER_SECRET": secret,
            "OMP_NUM_THREADS": "1",
        }
        try:
            for mode in WIRE_CONFIGS:
                address = f"127.0.0.1:{free_port('127.0.0.1')}"
                procs[mode] = subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.ps", "job", "wire_server", address, mode],
                    cwd=ROOT,
                    env={**env, **(tls_env if mode == "tls" else {})},
                )
                transport = GrpcTransport(tls=TlsConfig.from_env(tls_env) if mode == "tls" else None)
                tasks[mode] = RemoteTask(
                    "ps", 0, address, transport, secret.encode(), rpc_timeout=30.0, sender="chief:0"
                )
            grad = torch.randn(n)
            config = {"class": "SGD", "hyper": {"lr": 1e-6}}
            for mode, task in tasks.items():
                _wire_mode(mode)
                deadline = time.monotonic() + 60
                while True:
                    try:
                        task.call("create", {"vars": [{"key": "w", "trainable": True}]}, [torch.zeros(n)])
                        break
                    except Exception:  # noqa: BLE001 - still starting
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.2)

            # The training step of a worker: read the variables, forward and backward on a batch of 64,
            # send the gradients. The MLP has ``n`` parameters (a hidden layer sized to fit).
            width = 512
            hidden = max(1, n // (2 * width))
            torch.manual_seed(0)
            x, y = torch.randn(64, width), torch.randn(64, width)
            flat = torch.zeros(n)

            def step(task) -> None:
                flat.copy_(task.call("read", {"keys": ["w"]}).tensors[0])
                if compute:
                    params = flat[: 2 * width * hidden].view(2, hidden, width).detach().requires_grad_()
                    out = torch.relu(x @ params[0].t()) @ params[1]
                    torch.nn.functional.mse_loss(out, y).backward()
                    grad[: params.numel()] = params.grad.reshape(-1)
                task.call("apply", {"keys": ["w"], "group_of": [0], "optimizers": [config]}, [grad])

            import psutil

            servers = {m: psutil.Process(p.pid) for m, p in procs.items()}
            shuffle = random.Random(0).shuffle
            for mode in WIRE_CONFIGS:
                _wire_mode(mode)
                for _ in range(3):
                    step(tasks[mode])
            # Steps of the configurations alternate (in a rotating order), so that all of them see
            # the same load on a busy host; a round lasts ``seconds`` per configuration.
            per_round: dict[str, list[float]] = {m: [] for m in WIRE_CONFIGS}  # steps/s
            cpu: dict[str, list[float]] = {m: [] for m in WIRE_CONFIGS}  # CPU seconds per step, both processes
            step_s: dict[str, list[float]] = {m: [] for m in WIRE_CONFIGS}  # every step's duration
            for _ in range(rounds):
                busy = dict.fromkeys(WIRE_CONFIGS, 0.0)
                client_cpu = dict.fromkeys(WIRE_CONFIGS, 0.0)
                server_cpu = {m: sum(servers[m].cpu_times()[:2]) for m in WIRE_CONFIGS}
                start, i = time.perf_counter(), 0
                while time.perf_counter() - start < seconds * len(WIRE_CONFIGS):
                    order = list(WIRE_CONFIGS)
                    shuffle(order)  # a fixed cyclic order would give each configuration the same predecessor
                    for mode in order:
                        _wire_mode(mode)
                        c0, t0 = time.process_time(), time.perf_counter()
                        step(tasks[mode])
                        took = time.perf_counter() - t0
                        client_cpu[mode] += time.process_time() - c0
                        busy[mode] += took
                        step_s[mode].append(took)
                    i += 1
                for mode in WIRE_CONFIGS:
                    per_round[mode].append(i / busy[mode])
                    cpu[mode].append((client_cpu[mode] + sum(servers[mode].cpu_times()[:2]) - server_cpu[mode]) / i)
        finally:
            for mode, task in tasks.items():
                _wire_mode(mode)
                try:
                    task.call("shutdown", attempts=1)
                except Exception:  # noqa: BLE001
                    pass
                task.close()
            for p in procs.values():
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    ratio = lambda a, b: [x / y for x, y in zip(per_round[a], per_round[b])]  # noqa: E731
    summary = {
        "mb_of_gradients_per_step": mb,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "step": "read, forward+backward of an MLP (batch 64), apply" if compute else "read, apply (no compute)",
        "steps_per_s_median": {m: statistics.median(v) for m, v in per_round.items()},
        "steps": {m: len(v) for m, v in step_s.items()},
        # The same costs from every step's duration (pooled over rounds): less sensitive to a
        # round in which one configuration's process was preempted.
        "signing_cost_from_median_step": 1
        - statistics.median(step_s["head_only"]) / statistics.median(step_s["signed"]),
        "tls_cost_from_median_step": 1 - statistics.median(step_s["signed"]) / statistics.median(step_s["tls"]),
        "signing_every_byte_cost": 1 - statistics.median(ratio("signed", "head_only")),
        "signing_cost_spread": [1 - max(ratio("signed", "head_only")), 1 - min(ratio("signed", "head_only"))],
        "tls_cost": 1 - statistics.median(ratio("tls", "signed")),
        "tls_cost_spread": [1 - max(ratio("tls", "signed")), 1 - min(ratio("tls", "signed"))],
        "cpu_s_per_step_median": {m: statistics.median(v) for m, v in cpu.items()},
        # On a busy host throughput follows the CPU a step needs: the same costs, measured in CPU time.
        "signing_every_byte_cpu_cost": 1 - statistics.median([b / a for a, b in zip(cpu["signed"], cpu["head_only"])]),
        "tls_cpu_cost": 1 - statistics.median([b / a for a, b in zip(cpu["tls"], cpu["signed"])]),
        "in_process": wire_tag_cost(mb),
        "per_round_steps_per_s": per_round,
        "per_round_cpu_s_per_step": cpu,
    }
    return summary


# ------------------------------------------------------------------------------------------- driver
def _run(cmd: list[str], timeout: float = 150) -> None:
    # One thread per process everywhere: workers of both kinds compute alike, and on a small host
    # several multi-threaded processes oversubscribe the cores (10x slower steps measured on 2 cores).
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        timeout=timeout,
        check=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {done.returncode}:\n{done.stdout[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["job", "wire_server"]:
        wire_server(argv[2], argv[3])
        return 0
    if argv[:1] == ["job"]:  # inside a launched job: job {sync|async} OUT SECONDS [slow]
        kind, out, seconds = argv[1], argv[2], float(argv[3])
        sync_job(out, seconds, argv[4:] == ["slow"]) if kind == "sync" else async_job(out, seconds)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="timed seconds per measurement")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/ps.json (ps_wire.json with --wire)")
    parser.add_argument("--wire", action="store_true", help="measure the cost of signing every byte and of TLS")
    parser.add_argument("--mb", type=float, default=1.0, help="--wire: megabytes of gradients per step")
    parser.add_argument("--rounds", type=int, default=7, help="--wire: interleaved rounds")
    parser.add_argument("--no-compute", action="store_true", help="--wire: steps without the model's compute")
    args = parser.parse_args(argv)
    if args.wire:
        result = wire_bench(args.mb, args.rounds, min(args.seconds, 2.0), compute=not args.no_compute)
        out = Path(args.out or HERE / "results" / "ps_wire.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        for k, v in result["steps_per_s_median"].items():
            print(f"{k:<12}{v:>10.1f} steps/s ({args.mb:g} MB of gradients per step)")
        print(
            f"signing every byte costs {100 * result['signing_every_byte_cost']:.1f}% of step throughput "
            f"(rounds: {100 * result['signing_cost_spread'][0]:.1f}% to {100 * result['signing_cost_spread'][1]:.1f}%)"
        )
        print(
            f"TLS costs {100 * result['tls_cost']:.1f}% (rounds: {100 * result['tls_cost_spread'][0]:.1f}% to "
            f"{100 * result['tls_cost_spread'][1]:.1f}%)"
        )
        print(
            f"in CPU time per step (client + server): signing every byte {100 * result['signing_every_byte_cpu_cost']:.1f}%,"
            f" TLS {100 * result['tls_cpu_cost']:.1f}%"
        )
        print(
            f"from the median step ({sum(result['steps'].values())} steps): signing every byte "
            f"{100 * result['signing_cost_from_median_step']:.1f}%, TLS {100 * result['tls_cost_from_median_step']:.1f}%"
        )
        inproc = result["in_process"]
        print(
            f"in process: the body tag adds {inproc['tag_us_per_mib']:.0f} us of CPU per MiB signed and verified "
            f"(sign + chunk + verify of {args.mb:g} MB: {inproc['sign_and_verify_us_median']['signed']:.0f} us, "
            f"{inproc['sign_and_verify_us_median']['head_only']:.0f} us without the tag)"
        )
        print(f"wrote {out}")
        return 0
    args.out = args.out or str(HERE / "results" / "ps.json")

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
    result = {
        "machine": {"cpus": os.cpu_count()},
        "started": time.ctime(started),
        "seconds_per_measurement": args.seconds,
        "batch_per_worker": BATCH,
        "model": f"MLP {IN}-{HIDDEN}-{HIDDEN}-{OUT}",
        "worker_steps_per_s": {k: v for k, v in rows.items() if not k.endswith("sleep_s")},
        "samples_per_s": {k: v * BATCH for k, v in rows.items() if not k.endswith("sleep_s")},
        "straggler_sleep_s": {"sync": rows["sync_slow_sleep_s"], "async": rows["async_slow_sleep_s"]},
        "ratios": ratios,
        "wall_s": time.time() - started,
    }
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
