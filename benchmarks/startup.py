"""What starting a job costs: ``phalanx run`` (fork and spawn starts) and self-launch against torchrun.

``python -m benchmarks.startup [--rounds 3] [-n 2] [--launchers a,b]`` times a job that starts N
replicas, joins one collective and ends, from the launcher's start to its exit, as a user waits
for it: wall time and the CPU time of the launcher and every process it started (``os.wait4`` on
the launcher reaps its whole tree's usage). Four launchers, interleaved in rounds:

* ``torchrun``: ``python -m torch.distributed.run --nproc-per-node N`` of a plain DDP program
  (init_process_group, one all_reduce), the PyTorch baseline;
* ``phalanx run --start-method spawn`` and ``--start-method fork`` of the same program written
  with ``MirroredStrategy`` (one ``strategy.reduce``);
* ``self_launch``: ``python train.py`` of that program with ``MirroredStrategy(["cpu:0", ...])``,
  which starts its other replicas itself (the README's first program): a fresh interpreter each
  for up to two replicas, forked from a server that imported torch once for more.

Each runs twice: torch only, and with ``import keras`` at the top (Keras 3 on torch; its import
pulls in torch._dynamo and scikit-learn), as a Keras training script starts. Writes
``benchmarks/results/startup.json`` with medians and the ratios to torchrun (or, without it, to
``phalanx run``'s fork start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LAUNCHERS = ("torchrun", "phalanx_spawn", "phalanx_fork", "self_launch")

DDP = """{keras}import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""

PHALANX = """{keras}import torch, phalanx
strategy = phalanx.MirroredStrategy({devices})
total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1)), axis=None)
assert total.item() == strategy.num_replicas_in_sync
"""


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the launcher and all its descendants)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-n", type=int, default=2, help="replicas per job")
    parser.add_argument("--out", default=str(RESULTS / "startup.json"))
    parser.add_argument(
        "--launchers",
        default=",".join(LAUNCHERS),
        help=f"comma-separated, of {', '.join(LAUNCHERS)} (default: all)",
    )
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.launchers.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(LAUNCHERS))
    if unknown:
        parser.error(f"unknown launcher(s) {unknown}; choose among {', '.join(LAUNCHERS)}")
    load_at_start = os.getloadavg()  # the figures scale with what else the machine runs
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    env.pop("PHALANX_START_METHOD", None)
    phalanx_run = [sys.executable, "-m", "phalanx.cli", "run", "-n", str(args.n)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for flavour, keras_line in (("torch", ""), ("keras", "import keras\n")):
            ddp, px = Path(tmp, f"ddp_{flavour}.py"), Path(tmp, f"px_{flavour}.py")
            own = Path(tmp, f"px_self_{flavour}.py")
            ddp.write_text(DDP.format(keras=keras_line))
            px.write_text(PHALANX.format(keras=keras_line, devices=""))
            own.write_text(PHALANX.format(keras=keras_line, devices=[f"cpu:{i}" for i in range(args.n)]))
            launchers = {
                "torchrun": [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    str(args.n),
                    str(ddp),
                ],
                **{
                    f"phalanx_{method}": [*phalanx_run, "--start-method", method, str(px)]
                    for method in ("spawn", "fork")
                },
                "self_launch": [sys.executable, str(own)],
            }
            launchers = {name: cmd for name, cmd in launchers.items() if name in chosen}
            samples: dict[str, list[tuple[float, float]]] = {name: [] for name in launchers}
            for _ in range(args.rounds):
                for name, cmd in launchers.items():
                    samples[name].append(_timed(cmd, {**env, "PHALANX_LOG_ROOT": tmp}))
            row = {
                name: {
                    "wall_s": round(statistics.median(w for w, _ in s), 2),
                    "cpu_s": round(statistics.median(c for _, c in s), 2),
                }
                for name, s in samples.items()
            }
            base = "torchrun" if "torchrun" in row else "phalanx_fork" if "phalanx_fork" in row else None
            for name in row:
                if base is not None and name != base:
                    row[name][f"wall_vs_{base}"] = round(row[name]["wall_s"] / row[base]["wall_s"], 2)
                    row[name][f"cpu_vs_{base}"] = round(row[name]["cpu_s"] / row[base]["cpu_s"], 2)
            results[flavour] = row
            print(flavour, json.dumps(row, indent=1), flush=True)
    out = {
        "replicas": args.n,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "load_average_at_start": [round(x, 2) for x in load_at_start],
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
