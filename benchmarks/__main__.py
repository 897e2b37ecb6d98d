"""``python -m benchmarks`` (or ``phalanx bench``): the side-by-side benchmark suite.

Every configuration is a real job (real processes, real collectives), and configurations being
compared are interleaved in rounds. Each figure is the median of per-round paired ratios, with the
min-max spread, because a 2-core virtual machine drifts by 10-30 % over minutes. Writes
``latest.json`` and ``latest.png`` into ``--out`` (default: a new ``phalanx-bench-<timestamp>``
directory under the system's temporary directory, printed). The committed figures in
``benchmarks/results/`` change only when asked: ``--out benchmarks/results``.

Examples::

    python -m benchmarks                      # the full suite, about 9 minutes on 2 cores
    python -m benchmarks --quick              # a smoke run, well under a minute
    python -m benchmarks --rounds 5 --out ./my-run
    python -m benchmarks --configs px_mirrored,px_mirrored_compiled,local2 --models cnn
    python -m benchmarks --configs px_mirrored,ddp,local2 --models large_mlp --skip allreduce,overhead --load
    python -m benchmarks --device cuda        # every GPU: phalanx against DDP with NCCL

Overlap (``overlap`` in the report): the fraction of a step's communication hidden behind
backward, ``1 - (step - ceiling step) / communication alone``, where the ceiling is the same two
processes with no gradient exchange (``local2``) and "communication alone" all-reduces a buffer of
the model's gradient size each step with the same library (``px_comm`` for phalanx, ``torch_comm``
for DDP). 1.0: the exchange costs the step nothing; 0.0: it adds its whole duration. On a CPU the
exchange also competes with backward for the cores, so there it measures the cost of
communication rather than only waiting.

``--load`` adds the same throughput jobs under a background load (``benchmarks/load.py``: one busy
process per core and a DataLoader with 2 workers, started before each such job and ended after
it), shuffled into the same rounds as the idle jobs; the report's ``loaded`` part has their
figures and ratios beside the idle ones. Each loaded figure is the mean of ``--load-jobs`` (4)
shorter jobs shuffled into the round: a loaded job's speed is mostly where the kernel put its
replicas (on one core or two) for its few seconds, DDP's as much as phalanx's, so a single job
compares placements more than libraries; ``samples_per_s_per_job`` keeps each job's figure. Why a loaded job is slow: ``python -m
benchmarks.load_diag`` runs many short loaded jobs whose replicas record their CPU and run-queue
time, cores, step times and shared-memory waits (``PHALANX_BENCH_DIAG=<directory>``).

``--device cuda`` runs one replica per visible GPU (one process per GPU). On one GPU that is
the distribution layer's own cost: Mirrored of one replica (no collective), Mirrored with its
NCCL group built anyway (``px_mirrored_nccl``, PHALANX_SINGLE_REPLICA_COLLECTIVES=1) against DDP
over NCCL at world size 1, and, paired in one process, OneDeviceStrategy and Mirrored against the
raw loop. Without a CUDA device it prints why and exits with status 77 (skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.load import DESCRIPTION as LOAD_DESCRIPTION
from benchmarks.load import BackgroundLoad
from benchmarks.models import EXTRA_MODELS, MODELS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

THROUGHPUT_CONFIGS = {  # name -> how to launch it
    "px_mirrored": lambda m, out, s: [sys.executable, "-m", "benchmarks.worker", "px_mirrored", m, out, "--seconds", s],
    "px_mirrored_compiled": lambda m, out, s: [
        sys.executable,
        "-m",
        "benchmarks.worker",
        "px_mirrored_compiled",
        m,
        out,
        "--seconds",
        s,
    ],
    "px_mirrored_bf16": lambda m, out, s: [
        sys.executable,
        "-m",
        "benchmarks.worker",
        "px_mirrored_bf16",
        m,
        out,
        "--seconds",
        s,
    ],
    "px_comm": lambda m, out, s: [sys.executable, "-m", "benchmarks.worker", "px_comm", m, out, "--seconds", s],
    "px_mirrored_nccl": lambda m, out, s: _run2("px_mirrored_nccl", m, out, s),
    "px_one_device": lambda m, out, s: [
        sys.executable,
        "-m",
        "benchmarks.worker",
        "px_one_device",
        m,
        out,
        "--seconds",
        s,
    ],
    "torch_comm": lambda m, out, s: _run2("torch_comm", m, out, s),
    "px_mwms": lambda m, out, s: _run2("px_mwms", m, out, s),
    "ddp": lambda m, out, s: _run2("ddp", m, out, s),
    "local2": lambda m, out, s: _run2("local2", m, out, s),
    "one_process": lambda m, out, s: [sys.executable, "-m", "benchmarks.worker", "one_process", m, out, "--seconds", s],
}
if importlib.util.find_spec("tensorflow") is not None:  # optional reference: pip install tensorflow-cpu
    for _tf in ("tf_mirrored", "tf_mwms"):
        THROUGHPUT_CONFIGS[_tf] = (
            lambda c: lambda m, out, s: [sys.executable, "-m", "benchmarks.tf_worker", c, m, out, "--seconds", s]
        )(_tf)

CUDA_CONFIGS = (  # one_process and the TF rows are CPU comparisons
    "px_one_device",
    "px_mirrored_nccl",
    "px_mirrored",
    "px_mirrored_compiled",
    "px_mirrored_bf16",
    "px_comm",
    "torch_comm",
    "px_mwms",
    "ddp",
    "local2",
)
OVERLAP = {"px_mirrored": "px_comm", "px_mwms": "px_comm", "ddp": "torch_comm"}  # config -> its communication alone
SKIPPED = 77  # the exit status of a run that cannot take place here (automake's "skipped")
GLOBAL_BATCH = 256

RATIOS = [
    ("px_mirrored", "ddp"),
    ("px_mirrored_nccl", "ddp"),
    ("px_one_device", "local2"),
    ("px_mwms", "ddp"),
    ("px_mirrored", "local2"),
    ("px_mwms", "local2"),
    ("ddp", "local2"),
    ("px_mirrored", "one_process"),
    ("px_mirrored_compiled", "px_mirrored"),
    ("px_mirrored_bf16", "px_mirrored"),
    ("px_mirrored_compiled", "local2"),
    ("px_mirrored", "tf_mirrored"),
    ("px_mirrored_compiled", "tf_mirrored"),
    ("px_mwms", "tf_mwms"),
]


REPLICAS = {"n": 2}  # replicas of the multi-process configurations: 2 CPU processes, or one per GPU


def _run2(config: str, model: str, out: str, seconds: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "phalanx.cli",
        "run",
        "-n",
        str(REPLICAS["n"]),
        "-m",
        "benchmarks.worker",
        config,
        model,
        out,
        "--seconds",
        seconds,
    ]


def overlap(step_s: float, ceiling_s: float, comm_s: float) -> float:
    """The fraction of ``comm_s`` (communication alone) that a step of ``step_s`` hides.

    ``ceiling_s`` is the same step with no communication. Clamped to [0, 1]: noise can make a
    step a little faster than its ceiling, or slower by more than its communication.
    """
    if comm_s <= 0:
        raise ValueError(f"communication time must be positive; received {comm_s!r}")
    return min(1.0, max(0.0, 1.0 - (step_s - ceiling_s) / comm_s))


def _overlaps(raw: dict) -> dict:
    """Per model and config: the median (min, max) over rounds of :func:`overlap`, paired by round."""
    per_step = lambda sps: GLOBAL_BATCH / sps  # noqa: E731  # seconds per step (or per all-reduce)
    result: dict = {}
    for m, by_config in raw.items():
        for config, comm in OVERLAP.items():
            if not all(by_config.get(c) for c in (config, comm, "local2")):
                continue
            values = [
                overlap(per_step(a), per_step(b), per_step(c))
                for a, b, c in zip(by_config[config], by_config["local2"], by_config[comm])
            ]
            result.setdefault(m, {})[config] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
    return result


def _cuda_devices_missing() -> Exception | None:
    """Why ``--device cuda`` cannot run here (None if it can): it needs a CUDA device."""
    import torch

    from phalanx.errors import DeviceNotFoundError

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 1:
        return None
    return DeviceNotFoundError(
        "cuda:0",
        available=count,
        hint="--device cuda compares phalanx with DDP over NCCL, one replica per GPU; "
        "run it on a machine with a GPU, or leave --device out for the CPU suite",
    )


def _job(cmd: list[str], out: str, timeout: float = 420) -> dict:  # compiled configs compile for minutes
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("OMP_NUM_THREADS", None)
    subprocess.run(
        cmd, cwd=ROOT, env=env, timeout=timeout, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    with open(out) as f:
        return json.load(f)


def _interleaved(
    configs: dict,
    models: list[str],
    rounds: int,
    seconds: float,
    device: str = "cpu",
    loaded: dict | None = None,
    load_jobs: int = 1,
    loaded_jobs: dict | None = None,
    load_cores: dict | None = None,
) -> dict:
    """samples/s per model, config and round; config order shuffled in every round.

    ``loaded``: a dict that receives the same figures taken under the background load
    (``benchmarks/load.py``, started before each of those jobs and ended after it); those jobs are
    shuffled into the same rounds, so idle and loaded figures of a round share the machine's drift.
    A loaded figure is the mean of ``load_jobs`` jobs, each of ``seconds / load_jobs``, shuffled
    among the round's other jobs: where the kernel places a loaded job's replicas (one core or
    two) decides its speed for seconds, DDP's as much as phalanx's (``benchmarks/load_diag.py``),
    so one job per round compares placements more than libraries. ``loaded_jobs`` receives every
    job's figure, and ``load_cores`` the cores the load took beside each of them.
    """
    extra = ["--device", device] if device != "cpu" else []
    results = {m: {c: [] for c in configs} for m in models}
    conditions = {"idle": results}
    if loaded is not None:
        loaded.update({m: {c: [] for c in configs} for m in models})
        conditions["loaded"] = loaded
    jobs = loaded_jobs if loaded_jobs is not None else {}
    jobs.update({m: {c: [] for c in configs} for m in models})
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for m in models:
                order = [
                    (c, cond, k)
                    for cond in conditions
                    for c in configs
                    for k in range(load_jobs if cond == "loaded" else 1)
                ]
                random.Random(r * 31 + len(m)).shuffle(order)
                parts: dict = {c: [] for c in configs}
                for c, cond, k in order:
                    out = os.path.join(tmp, f"{c}-{m}-{r}-{cond}-{k}.json")
                    timed = seconds / load_jobs if cond == "loaded" else seconds
                    load = BackgroundLoad() if cond == "loaded" else None
                    with load if load is not None else contextlib.nullcontext():
                        value = _job([*configs[c](m, out, str(timed)), *extra], out)["samples_per_s"]
                    if load is not None:
                        parts[c].append(value)
                        jobs[m][c].append(value)
                        if load_cores is not None:
                            load_cores.setdefault(m, {}).setdefault(c, []).append(load.cores)
                    else:
                        results[m][c].append(value)
                    label = f"{c} (loaded {k + 1}/{load_jobs})" if cond == "loaded" else c
                    print(f"  round {r + 1}/{rounds} {m:<10} {label:<27} {value:>10.0f} samples/s", flush=True)
                if loaded is not None:
                    for c in configs:
                        loaded[m][c].append(statistics.fmean(parts[c]))
    return results


def _overhead(models: list[str], rounds: int, seconds: float, device: str = "cpu") -> dict:
    """OneDeviceStrategy (and on a GPU, Mirrored of one replica) and the raw loop, paired within
    one process per model and round."""
    sides = ("px_one_device", "px_mirrored", "raw") if device == "cuda" else ("px_one_device", "raw")
    results: dict = {m: {c: [] for c in sides} for m in models}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for m in models:
                out = os.path.join(tmp, f"overhead-{m}-{r}.json")
                cmd = [sys.executable, "-m", "benchmarks.worker", "overhead_pair", m, out, "--seconds", str(seconds)]
                pair = _job([*cmd, "--device", device], out)
                for c in results[m]:
                    results[m][c].append(pair[c])
                shown = "  ".join(f"{c} {pair[c]:>9.0f}" for c in sides)
                print(f"  round {r + 1}/{rounds} {m:<10} {shown} samples/s", flush=True)
    return results


def _ratios(raw: dict, models: list[str]) -> dict:
    """Per model, the paired-round ratio of every pair in RATIOS that was measured."""
    return {
        m: {f"{a}_vs_{b}": _ratio(raw[m][a], raw[m][b]) for a, b in RATIOS if a in raw[m] and b in raw[m]}
        for m in models
    }


def _ratio(a: list[float], b: list[float]) -> dict:
    ratios = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def memory_bandwidth_gbps() -> float:
    """Copy bandwidth (bytes read + written per second) of a 256 MiB numpy copy, best of 5."""
    src = np.ones(64 << 20, dtype=np.float32)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    models = list(report["throughput"]["ratios"])
    keys = [
        ("px_mirrored_vs_ddp", "Mirrored / DDP"),
        ("px_mwms_vs_ddp", "MWMS / DDP"),
        ("px_mirrored_vs_local2", "Mirrored / no-comm ceiling"),
        ("ddp_vs_local2", "DDP / no-comm ceiling"),
    ]
    width = 0.2
    for i, (key, label) in enumerate(keys):
        vals = [report["throughput"]["ratios"][m][key]["median"] for m in models]
        axes[0].bar([j + i * width for j in range(len(models))], vals, width, label=label)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set_xticks([j + 1.5 * width for j in range(len(models))], models)
    axes[0].set_ylabel("throughput ratio (median of paired rounds)")
    axes[0].set_title("Synchronous data parallelism, 2 CPU processes, batch 256, Adam")
    axes[0].legend(fontsize=8)
    rows = report["allreduce"]["rows"]
    sizes = [r["bytes"] for r in rows]
    axes[1].loglog(sizes, [r["phalanx_busbw_gbps"] for r in rows], "o-", label="phalanx")
    axes[1].loglog(sizes, [r["gloo_busbw_gbps"] for r in rows], "s-", label="raw gloo")
    axes[1].axhline(
        report["allreduce"]["memory_bandwidth_gbps"] / 2,
        color="gray",
        linestyle="--",
        label="memory copy bandwidth / 2",
    )
    axes[1].set_xlabel("bytes")
    axes[1].set_ylabel("bus bandwidth (GB/s)")
    axes[1].set_title("All-reduce, 2 processes")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine(device: str = "cpu") -> dict:
    """What the figures depend on: the CPU model and count (and the GPUs with --device cuda)."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpus": os.cpu_count(), "cpu_model": cpu, "torch": torch.__version__}
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        try:  # the driver, as nvidia-smi reports it
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info


def default_out_dir() -> Path:
    """A fresh directory outside the repository, so a run never overwrites the committed figures."""
    return Path(tempfile.gettempdir()) / f"phalanx-bench-{time.strftime('%Y%m%d-%H%M%S')}"


PROG = "python -m benchmarks"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The suite's options; ``prog`` is the command the user typed (``phalanx bench`` runs it too),
    which the usage line and the examples name."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="The side-by-side benchmark suite ('python -m benchmarks' or 'phalanx bench'): "
        "every configuration is a real job, compared in interleaved rounds.",
        epilog=__doc__[__doc__.index("Examples::") :].replace("::", ":").replace(PROG, prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=None,
        help="interleaved rounds per configuration (default: 3; 1 with --quick)",
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="timed seconds per job (default: 2.0; 0.3 with --quick)"
    )
    parser.add_argument(
        "--models",
        default=None,
        help=f"comma list of {','.join(MODELS + EXTRA_MODELS)} (default: {','.join(MODELS)}; seed_mlp with --quick)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default): 2 CPU replicas; cuda: one replica per GPU, DDP with NCCL "
        "(exits 77, skipped, without a GPU)",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help="comma list of throughput configurations to time (default: all that run here); "
        f"choose from {','.join(THROUGHPUT_CONFIGS)}",
    )
    parser.add_argument("--skip", default="", help="comma list of: throughput,allreduce,overhead (default: none)")
    parser.add_argument(
        "--load",
        action="store_true",
        help=f"also time every throughput configuration under a background load ({LOAD_DESCRIPTION}), "
        "started before and ended after each such job, interleaved with the idle jobs; the report's "
        "'loaded' part",
    )
    parser.add_argument(
        "--load-jobs",
        type=_positive,
        default=4,
        help="with --load: each loaded figure is the mean of this many jobs of --seconds / N each, "
        "as many placements of the replicas on the cores (default: 4)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for latest.json and latest.png (default: a new "
        "phalanx-bench-<timestamp> directory in the temporary directory; "
        "benchmarks/results updates the committed figures)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run in under a minute: the seed MLP under Mirrored, DDP and the "
        "no-communication ceiling, short jobs, all-reduce up to 1 MB, no chart; its "
        "ratios are too noisy to quote",
    )
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; received {text!r}")
    return int(text)


def main(argv: list[str] | None = None, *, prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 2.0)
    models = (args.models or ("seed_mlp" if args.quick else ",".join(MODELS))).split(",")
    unknown = [m for m in models if m not in MODELS + EXTRA_MODELS]
    if unknown:
        parser.error(f"--models: unknown model(s) {unknown}; choose from {','.join(MODELS + EXTRA_MODELS)}")
    chosen = args.configs.split(",") if args.configs else None
    if chosen and set(chosen) - set(THROUGHPUT_CONFIGS):
        parser.error(
            f"--configs: unknown or unavailable configuration(s) {sorted(set(chosen) - set(THROUGHPUT_CONFIGS))}; "
            f"choose from {','.join(THROUGHPUT_CONFIGS)}"
        )
    skip = set(filter(None, args.skip.split(",")))
    if skip - {"throughput", "allreduce", "overhead"}:
        parser.error(
            f"--skip: unknown part(s) {sorted(skip - {'throughput', 'allreduce', 'overhead'})}; "
            "choose from throughput,allreduce,overhead"
        )
    if args.device == "cuda":
        missing = _cuda_devices_missing()
        if missing is not None:
            print(f"phalanx bench --device cuda: skipped: {type(missing).__name__}: {missing}", file=sys.stderr)
            return SKIPPED
        skip |= {"allreduce"}  # a CPU measurement: gloo against phalanx's shared memory
        import torch

        REPLICAS["n"] = torch.cuda.device_count()
    out_dir = (args.out or default_out_dir()).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"results go to {out_dir}", flush=True)
    report: dict = {
        "machine": machine(args.device),
        "device": args.device,
        "rounds": args.rounds,
        "started": time.ctime(),
        "quick": args.quick,
    }
    start = time.monotonic()

    def save() -> None:
        # After each section too: a run stopped at its time limit (the GPU script's) keeps what it measured.
        report["elapsed_s"] = time.monotonic() - start
        (out_dir / "latest.json").write_text(json.dumps(report, indent=1))

    if "throughput" not in skip:
        print("throughput (samples/s):", flush=True)
        # --quick times only the headline comparison (Mirrored against DDP and the ceiling).
        names = tuple(chosen or (("px_mirrored", "ddp", "local2") if args.quick else THROUGHPUT_CONFIGS))
        if args.device == "cuda":
            names = tuple(c for c in names if c in CUDA_CONFIGS)
        elif not chosen:  # the rows that only mean something on a GPU (a CPU has the overhead pair)
            names = tuple(c for c in names if c not in ("px_one_device", "px_mirrored_nccl"))
            if REPLICAS["n"] == 1:  # nothing to overlap, and Mirrored is already its one-process self
                names = tuple(c for c in names if c not in ("px_comm", "torch_comm", "px_mwms"))
            else:
                names = tuple(c for c in names if c != "px_mirrored_nccl")
        configs = {c: THROUGHPUT_CONFIGS[c] for c in names}
        loaded: dict | None = {} if args.load else None
        loaded_jobs: dict = {}
        load_cores: dict = {}
        raw = _interleaved(
            configs, models, args.rounds, args.seconds, args.device, loaded, args.load_jobs, loaded_jobs, load_cores
        )
        report["throughput"] = {"samples_per_s": raw, "ratios": _ratios(raw, models), "overlap": _overlaps(raw)}
        if loaded is not None:
            report["loaded"] = {
                "load": LOAD_DESCRIPTION,
                "jobs_per_figure": args.load_jobs,
                "seconds_per_job": args.seconds / args.load_jobs,
                "samples_per_s": loaded,
                "samples_per_s_per_job": loaded_jobs,
                "load_cores_per_job": load_cores,  # CPU time of the load / wall time, beside each job
                "ratios": _ratios(loaded, models),
                "overlap": _overlaps(loaded),
            }
        save()
    if "allreduce" not in skip:
        print("all-reduce:", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "allreduce.json")
            sizes = ["--max-bytes", str(1 << 20)] if args.quick else []
            rows = _job(
                [
                    sys.executable,
                    "-m",
                    "phalanx.cli",
                    "run",
                    "-n",
                    "2",
                    "-m",
                    "benchmarks.allreduce",
                    out,
                    "--rounds",
                    str(args.rounds if args.quick else max(3, args.rounds)),
                    *sizes,
                ],
                out,
                timeout=600,
            )
        report["allreduce"] = {"rows": rows, "memory_bandwidth_gbps": memory_bandwidth_gbps()}
        for r in rows:
            print(
                f"  {r['bytes']:>10} B  phalanx {r['phalanx_us']:>9.1f} us {r['phalanx_busbw_gbps']:>6.2f} GB/s   "
                f"gloo {r['gloo_us']:>9.1f} us {r['gloo_busbw_gbps']:>6.2f} GB/s   ratio {r['ratio_busbw']:.2f}x"
            )
    if "overhead" not in skip:
        print("OneDeviceStrategy overhead:", flush=True)
        mlps = models if args.device == "cuda" else [m for m in models if m.endswith("mlp")]
        raw = _overhead(mlps, args.rounds, args.seconds, args.device)
        report["overhead"] = {
            "samples_per_s": raw,
            "ratios": {m: _ratio(raw[m]["px_one_device"], raw[m]["raw"]) for m in mlps},
        }
        if args.device == "cuda":
            report["overhead"]["mirrored_ratios"] = {m: _ratio(raw[m]["px_mirrored"], raw[m]["raw"]) for m in mlps}
    save()
    print(summary(report))
    print(f"results: {out_dir / 'latest.json'}")
    if "throughput" in report and "allreduce" in report and not args.quick:
        try:
            chart(report, out_dir / "latest.png")
            print(f"chart: {out_dir / 'latest.png'}")
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[bench]'); no chart")
    return 0


def summary(report: dict) -> str:
    lines = ["", "ratios (median of paired rounds, [min, max]):"]
    fmt = lambda r: f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]"  # noqa: E731
    for part, label in (("throughput", "idle"), ("loaded", "loaded")):
        for m, rs in report.get(part, {}).get("ratios", {}).items():
            for k, r in rs.items():
                lines.append(f"  {m:<10} {k:<28} {label:<7} {fmt(r)}")
    if "loaded" in report:
        lines.append(f"  (loaded: {report['loaded']['load']}, during each job)")
    for m, by_config in report.get("throughput", {}).get("overlap", {}).items():
        for c, r in by_config.items():
            lines.append(f"  {m:<10} {'overlap_' + c:<28} {fmt(r).replace('x', '')}")
    for m, r in report.get("overhead", {}).get("ratios", {}).items():
        lines.append(f"  {m:<10} {'px_one_device_vs_raw':<28} {fmt(r)}")
    for m, r in report.get("overhead", {}).get("mirrored_ratios", {}).items():
        lines.append(f"  {m:<10} {'px_mirrored_1gpu_vs_raw':<28} {fmt(r)}")
    lines.append(f"elapsed: {report['elapsed_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
