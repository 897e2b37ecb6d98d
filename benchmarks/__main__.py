"""``python -m benchmarks`` (or ``phalanx bench``): the side-by-side benchmark suite.

Every configuration is a real job (real processes, real collectives), and configurations being
compared are interleaved in rounds. Each figure is the median of per-round paired ratios, with the
min-max spread, because a 2-core virtual machine drifts by 10-30 % over minutes. Writes
``benchmarks/results/latest.json`` and ``latest.png``.
"""

from __future__ import annotations

import argparse
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

THROUGHPUT_CONFIGS = {  # name -> how to launch it
    "px_mirrored": lambda m, out, s: [sys.executable, "-m", "benchmarks.worker", "px_mirrored", m, out, "--seconds", s],
    "px_mirrored_compiled": lambda m, out, s: [sys.executable, "-m", "benchmarks.worker", "px_mirrored_compiled", m,
                                               out, "--seconds", s],
    "px_mirrored_bf16": lambda m, out, s: [sys.executable, "-m", "benchmarks.worker", "px_mirrored_bf16", m, out,
                                           "--seconds", s],
    "px_mwms": lambda m, out, s: _run2("px_mwms", m, out, s),
    "ddp": lambda m, out, s: _run2("ddp", m, out, s),
    "local2": lambda m, out, s: _run2("local2", m, out, s),
    "one_process": lambda m, out, s: [sys.executable, "-m", "benchmarks.worker", "one_process", m, out, "--seconds", s],
}
if importlib.util.find_spec("tensorflow") is not None:  # optional reference: pip install tensorflow-cpu
    for _tf in ("tf_mirrored", "tf_mwms"):
        THROUGHPUT_CONFIGS[_tf] = (lambda c: lambda m, out, s: [sys.executable, "-m", "benchmarks.tf_worker", c, m,
                                                                out, "--seconds", s])(_tf)

def _run2(config: str, model: str, out: str, seconds: str) -> list[str]:
    return [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", "-m", "benchmarks.worker", config, model, out,
            "--seconds", seconds]


def _job(cmd: list[str], out: str, timeout: float = 420) -> dict:  # compiled configs compile for minutes
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("OMP_NUM_THREADS", None)
    subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def _interleaved(configs: dict, models: list[str], rounds: int, seconds: float) -> dict:
    """samples/s per model, config and round; config order shuffled in every round."""
    results = {m: {c: [] for c in configs} for m in models}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for m in models:
                order = list(configs)
                random.Random(r * 31 + len(m)).shuffle(order)
                for c in order:
                    out = os.path.join(tmp, f"{c}-{m}-{r}.json")
                    results[m][c].append(_job(configs[c](m, out, str(seconds)), out)["samples_per_s"])
                    print(f"  round {r + 1}/{rounds} {m:<10} {c:<14} {results[m][c][-1]:>10.0f} samples/s",
                          flush=True)
    return results


def _overhead(models: list[str], rounds: int, seconds: float) -> dict:
    """OneDeviceStrategy and the raw loop, paired within one process per model and round."""
    results = {m: {"px_one_device": [], "raw": []} for m in models}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for m in models:
                out = os.path.join(tmp, f"overhead-{m}-{r}.json")
                pair = _job([sys.executable, "-m", "benchmarks.worker", "overhead_pair", m, out, "--seconds",
                             str(seconds)], out)
                for c in results[m]:
                    results[m][c].append(pair[c])
                print(f"  round {r + 1}/{rounds} {m:<10} px_one_device {pair['px_one_device']:>9.0f}  "
                      f"raw {pair['raw']:>9.0f} samples/s", flush=True)
    return results


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
    keys = [("px_mirrored_vs_ddp", "Mirrored / DDP"), ("px_mwms_vs_ddp", "MWMS / DDP"),
            ("px_mirrored_vs_local2", "Mirrored / no-comm ceiling"), ("ddp_vs_local2", "DDP / no-comm ceiling")]
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
    axes[1].axhline(report["allreduce"]["memory_bandwidth_gbps"] / 2, color="gray", linestyle="--",
                    label="memory copy bandwidth / 2")
    axes[1].set_xlabel("bytes")
    axes[1].set_ylabel("bus bandwidth (GB/s)")
    axes[1].set_title("All-reduce, 2 processes")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per job")
    parser.add_argument("--models", default="seed_mlp,large_mlp,cnn")
    parser.add_argument("--skip", default="", help="comma list of: throughput,allreduce,overhead")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    models = args.models.split(",")
    skip = set(filter(None, args.skip.split(",")))
    report: dict = {"machine": {"cpus": os.cpu_count()}, "rounds": args.rounds, "started": time.ctime()}
    start = time.monotonic()
    if "throughput" not in skip:
        print("throughput (samples/s):", flush=True)
        raw = _interleaved(THROUGHPUT_CONFIGS, models, args.rounds, args.seconds)
        ratios = {m: {
            "px_mirrored_vs_ddp": _ratio(raw[m]["px_mirrored"], raw[m]["ddp"]),
            "px_mwms_vs_ddp": _ratio(raw[m]["px_mwms"], raw[m]["ddp"]),
            "px_mirrored_vs_local2": _ratio(raw[m]["px_mirrored"], raw[m]["local2"]),
            "px_mwms_vs_local2": _ratio(raw[m]["px_mwms"], raw[m]["local2"]),
            "ddp_vs_local2": _ratio(raw[m]["ddp"], raw[m]["local2"]),
            "px_mirrored_vs_one_process": _ratio(raw[m]["px_mirrored"], raw[m]["one_process"]),
            "px_mirrored_compiled_vs_px_mirrored": _ratio(raw[m]["px_mirrored_compiled"], raw[m]["px_mirrored"]),
            "px_mirrored_bf16_vs_px_mirrored": _ratio(raw[m]["px_mirrored_bf16"], raw[m]["px_mirrored"]),
            "px_mirrored_compiled_vs_local2": _ratio(raw[m]["px_mirrored_compiled"], raw[m]["local2"]),
            **({"px_mirrored_vs_tf_mirrored": _ratio(raw[m]["px_mirrored"], raw[m]["tf_mirrored"]),
                "px_mirrored_compiled_vs_tf_mirrored": _ratio(raw[m]["px_mirrored_compiled"], raw[m]["tf_mirrored"]),
                "px_mwms_vs_tf_mwms": _ratio(raw[m]["px_mwms"], raw[m]["tf_mwms"])} if "tf_mwms" in raw[m] else {}),
        } for m in models}
        report["throughput"] = {"samples_per_s": raw, "ratios": ratios}
    if "allreduce" not in skip:
        print("all-reduce:", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "allreduce.json")
            rows = _job([sys.executable, "-m", "phalanx.cli", "run", "-n", "2", "-m", "benchmarks.allreduce", out,
                  "--rounds", str(max(3, args.rounds))], out, timeout=600)
        report["allreduce"] = {"rows": rows, "memory_bandwidth_gbps": memory_bandwidth_gbps()}
        for r in rows:
            print(f"  {r['bytes']:>10} B  phalanx {r['phalanx_us']:>9.1f} us {r['phalanx_busbw_gbps']:>6.2f} GB/s   "
                  f"gloo {r['gloo_us']:>9.1f} us {r['gloo_busbw_gbps']:>6.2f} GB/s   ratio {r['ratio_busbw']:.2f}x")
    if "overhead" not in skip:
        print("OneDeviceStrategy overhead:", flush=True)
        mlps = [m for m in models if m.endswith("mlp")]
        raw = _overhead(mlps, args.rounds, args.seconds)
        report["overhead"] = {"samples_per_s": raw,
                              "ratios": {m: _ratio(raw[m]["px_one_device"], raw[m]["raw"]) for m in mlps}}
    report["elapsed_s"] = time.monotonic() - start
    (RESULTS / "latest.json").write_text(json.dumps(report, indent=1))
    print(summary(report))
    if "throughput" in report and "allreduce" in report:
        try:
            chart(report, RESULTS / "latest.png")
            print(f"chart: {RESULTS / 'latest.png'}")
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[bench]'); no chart")
    return 0


def summary(report: dict) -> str:
    lines = ["", "ratios (median of paired rounds, [min, max]):"]
    fmt = lambda r: f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]"  # noqa: E731
    for m, rs in report.get("throughput", {}).get("ratios", {}).items():
        for k, r in rs.items():
            lines.append(f"  {m:<10} {k:<28} {fmt(r)}")
    for m, r in report.get("overhead", {}).get("ratios", {}).items():
        lines.append(f"  {m:<10} {'px_one_device_vs_raw':<28} {fmt(r)}")
    lines.append(f"elapsed: {report['elapsed_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
