"""Many short jobs under the background load, with per-replica diagnostics (issue 33).

    python -m benchmarks.load_diag OUT_DIR [--jobs 16] [--seconds 2] [--configs px_mirrored,ddp]
        [--model large_mlp] [--idle] [--env NAME=CONFIG:VAR=VALUE ...]

Runs ``--jobs`` jobs of each configuration, alternating, each under ``benchmarks/load.py``'s load
(or idle with ``--idle``), with ``PHALANX_BENCH_DIAG`` on: every replica writes its wall and CPU
time, context switches, run-queue wait, autogroup, CPUs and step times, and every shared-memory
communicator its wait statistics. ``--env`` adds a variant: a config
name of its own that runs CONFIG with an environment variable set (e.g.
``--env old=px_mirrored:PHALANX_SHM_SPIN=static``), interleaved with the others. Writes
``OUT_DIR/diag.json`` (one record per job) and prints one line per job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks.__main__ import THROUGHPUT_CONFIGS, _job, machine
from benchmarks.load import DESCRIPTION, BackgroundLoad


def _read(directory: Path) -> tuple[list[dict], list[dict]]:
    replicas = [json.loads(p.read_text()) for p in sorted(directory.glob("replica-*.json"))]
    shm = [json.loads(p.read_text()) for p in sorted(directory.glob("shm-*.json"))]
    return sorted(replicas, key=lambda r: r["rank"]), sorted(shm, key=lambda r: r["rank"])


def _line(record: dict) -> str:
    load = "" if record.get("load_cores") is None else f" load {record['load_cores']:.2f} cores"
    parts = [f"{record['name']:<12} {record['samples_per_s']:>7.0f}/s same cpu {record.get('same_cpu', 0):.2f}{load}"]
    for r in record["replicas"]:
        cpu = r["user_s"] + r["sys_s"]
        parts.append(
            f"r{r['rank']}: cpu {cpu / r['wall_s']:.2f} main run {r['main_run_s'] / r['wall_s']:.2f} "
            f"rq {r['main_runqueue_s'] / r['wall_s']:.2f} "
            f"vcs {r['nvcsw']:>5} ics {r['nivcsw']:>4} p90 {r['step_p90_ms']:6.1f} max {r['step_max_ms']:6.1f} "
            f"cpus {r['cpus']} ag {r['autogroup']}"
        )
    for s in record["shm"]:
        parts.append(
            f"shm{s['rank']}: waits {s['waits']} wait {s['wait_s']:.2f}s cpu {s['wait_cpu_s']:.2f}s "
            f"past {s['past_spin']} sleeps {s['sleeps']} {s['sleep_s']:.2f}s hist {s['histogram_us']}"
        )
    return "\n    ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--configs", default="px_mirrored,ddp")
    parser.add_argument("--model", default="large_mlp")
    parser.add_argument("--idle", action="store_true")
    parser.add_argument("--env", action="append", default=[], help="NAME=CONFIG:VAR=VALUE, a variant")
    args = parser.parse_args()
    variants = {c: (c, {}) for c in args.configs.split(",") if c}
    for spec in args.env:
        name, _, rest = spec.partition("=")
        config, _, assignment = rest.partition(":")
        var, _, value = assignment.partition("=")
        variants[name] = (config, {var: value})
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(args.jobs):
        names = list(variants) if i % 2 == 0 else list(reversed(variants))  # no side always first
        for name in names:
            config, extra = variants[name]
            directory = args.out / f"{i:02d}-{name}"
            directory.mkdir(exist_ok=True)
            saved = {k: os.environ.get(k) for k in ("PHALANX_BENCH_DIAG", *extra)}
            os.environ.update({"PHALANX_BENCH_DIAG": str(directory), **extra})
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "out.json")
                    cmd = THROUGHPUT_CONFIGS[config](args.model, out, str(args.seconds))
                    load = None
                    if args.idle:
                        result = _job(cmd, out)
                    else:
                        with BackgroundLoad() as load:
                            result = _job(cmd, out)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            replicas, shm = _read(directory)
            record = {"job": i, "name": name, "samples_per_s": result["samples_per_s"], "replicas": replicas}
            record["load_cores"] = load.cores if load is not None else None
            record["shm"] = shm
            if len(replicas) == 2:  # steps run in lockstep: step k of one replica beside step k of the other
                pairs = list(zip(replicas[0]["cpu_per_step"], replicas[1]["cpu_per_step"]))
                record["same_cpu"] = sum(a == b for a, b in pairs) / max(1, len(pairs))
            for r in record["replicas"]:
                r.pop("step_times_ms", None)  # kept in the per-job files
                r.pop("cpu_per_step", None)
            records.append(record)
            print(f"{i:02d} {_line(record)}", flush=True)
    report = {"machine": machine(), "load": None if args.idle else DESCRIPTION, "jobs": records}
    (args.out / "diag.json").write_text(json.dumps(report, indent=1))
    print(summary(records))


def summary(records: list[dict]) -> str:
    """Per variant: samples/s (median, min, max) and the longest step of each job (median, max).

    A job whose longest step is many times its median step lost its replicas' CPU for that long:
    the stalls that make a loaded round collapse.
    """
    lines = []
    for name in dict.fromkeys(r["name"] for r in records):
        jobs = [r for r in records if r["name"] == name]
        values = [r["samples_per_s"] for r in jobs]
        longest = [max(x["step_max_ms"] for x in r["replicas"]) for r in jobs]
        lines.append(
            f"{name:<12} samples/s median {statistics.median(values):.0f} min {min(values):.0f} "
            f"max {max(values):.0f}; longest step median {statistics.median(longest):.0f} ms, "
            f"max {max(longest):.0f} ms; jobs with a step over 1 s: {sum(t > 1000 for t in longest)}/{len(jobs)}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
