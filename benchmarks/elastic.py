"""What being elastic costs: recovery after a lost replica, and the steady-state cost of the vote.

``python -m benchmarks.elastic [--model large_mlp] [--rounds 3] [--steps 80]`` runs a
MirroredStrategy training loop (a model of ``benchmarks.models``) under ``phalanx run`` and writes
``benchmarks/results/elastic.json`` with the machine it ran on:

* **recovery**: ``phalanx run -n 3 --min-nproc 2``, replica 2 kills itself (SIGKILL) at the
  middle step, after writing the time. Measured on the survivors: from the kill to the end of
  the step it interrupted, run again by the two of them (``trains_again_s``: failure detection,
  the abandoned attempt, the group re-formed, the step's new attempt), and how long the group
  took to re-form (``regroup_s``, phalanx's own :class:`~phalanx.MembershipChange` figure).
  ``phalanx run`` then starts a replacement: ``rejoin_s`` is the members' time to admit it and
  send it the state (the re-formed group, the variables and the optimizer's state), when it
  joined before the data ended. Target: the job trains again within 10 s on CPU replicas.
* **steady state**: the same loop, nobody killed, ``phalanx run -n 2`` against
  ``phalanx run -n 2 --min-nproc 2``, interleaved over ``--rounds`` rounds (which runs first
  alternates); the median step time
  of each (after a warm-up) and their ratio, and the time the vote itself took per step, timed in
  the job (``vote_share_of_plain_step``: what the ratio would be without the noise of two jobs).
  Target: at most 1.02 (2 % of a step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent

PROGRAM = """
import json, os, signal, sys, time
import torch
import phalanx as px
from benchmarks.models import workload

model_name, steps, kill_at, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
member = int(os.environ.get("PHALANX_JOIN_AS") or os.environ["PHALANX_RANK"])  # a replacement: 3
torch.manual_seed(0)
w = workload(model_name)
strategy = px.MirroredStrategy()
changes = []
px.on_membership_change(lambda c: changes.append({"step": c.step, "seconds": c.seconds, "joined": len(c.joined)}))
with strategy.scope():
    model = w.make()
    opt = w.make_optimizer(model.parameters())
data = w.batches(w.global_batch, steps)

def step_fn(x, y):
    loss = px.nn.compute_average_loss(w.per_example_loss(model(x), y))
    opt.zero_grad()
    loss.backward()
    opt.step()

ends = []
for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
    if i + 1 == kill_at and member == 2:
        with open(os.path.join(out, "killed_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    strategy.run(step_fn, args=(x, y))
    ends.append(time.time())
vote = getattr(strategy.extended.communicator, "vote_seconds", None)
with open(os.path.join(out, f"replica_{member}.json"), "w") as f:
    json.dump({"member": member, "ends": ends, "changes": changes, "vote_s": vote, "steps": len(ends)}, f)
"""


def _machine() -> dict[str, object]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def _job(work: Path, args: list[str], model: str, steps: int, kill_at: int) -> list[dict]:
    out = Path(tempfile.mkdtemp(dir=work))
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PHALANX_LOG_ROOT": str(work),
    }
    cmd = [
        sys.executable,
        "-m",
        "phalanx.cli",
        "run",
        *args,
        str(work / "program.py"),
        model,
        str(steps),
        str(kill_at),
        str(out),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    found = [json.loads(p.read_text()) for p in sorted(out.glob("replica_*.json"))]
    killed = out / "killed_at"
    if killed.exists():
        for f in found:
            f["killed_at"] = float(killed.read_text())
    return found


def _step_times(ends: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="large_mlp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--out", default=str(RESULTS / "elastic.json"))
    args = parser.parse_args(argv)
    warmup = 10
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "program.py").write_text(PROGRAM)
        recoveries = []
        plain: list[float] = []
        elastic: list[float] = []
        votes: list[float] = []
        rounds = []
        for _ in range(args.rounds):
            # Replica 2 is lost at kill_at; phalanx run starts a replacement (replica 3), which joins later.
            found = _job(work, ["-n", "3", "--min-nproc", "2"], args.model, args.steps, args.steps // 2)
            survivors = [s for s in found if s["member"] in (0, 1)]
            kill_at = args.steps // 2
            joins = [c["seconds"] for s in survivors for c in s["changes"] if c["joined"]]
            recoveries.append(
                {
                    "trains_again_s": max(s["ends"][kill_at - 1] - s["killed_at"] for s in survivors),
                    "regroup_s": max(s["changes"][0]["seconds"] for s in survivors),
                    # The members' time to admit the replacement and send it the state (None: it
                    # did not join before the data ended).
                    "rejoin_s": max(joins) if joins else None,
                    "step_s_before": statistics.median(_step_times(survivors[0]["ends"][: kill_at - 1], warmup)),
                }
            )
            # Plain and elastic in turn, the order swapped every round: on a shared 2-core machine the
            # job that runs second is often slower or faster as a whole (a fixed order gave 1.2x by
            # the median of 7 rounds where the alternating one gives 1.01x, the vote timed at 1.3 %).
            order = [("plain", ["-n", "2"]), ("elastic", ["-n", "2", "--min-nproc", "2"])]
            timed: dict[str, float] = {}
            for name, job_args in order if len(rounds) % 2 == 0 else reversed(order):
                replicas = _job(work, job_args, args.model, args.steps, 0)
                timed[name] = statistics.median(_step_times(replicas[0]["ends"], warmup))
                if name == "elastic":
                    vote = max(r["vote_s"] / r["steps"] for r in replicas)
            a, b = timed["plain"], timed["elastic"]
            plain.append(a)
            elastic.append(b)
            votes.append(vote)
            rounds.append(
                {"plain_step_s": a, "elastic_step_s": b, "ratio": b / a, "vote_s_per_step": vote, **recoveries[-1]}
            )
            print(json.dumps(rounds[-1]), flush=True)
    result = {
        "machine": _machine(),
        "model": args.model,
        "steps": args.steps,
        "rounds": rounds,
        "recovery": {
            "trains_again_s_median": statistics.median(x["trains_again_s"] for x in recoveries),
            "trains_again_s_max": max(x["trains_again_s"] for x in recoveries),
            "regroup_s_median": statistics.median(x["regroup_s"] for x in recoveries),
            "rejoin_s": [x["rejoin_s"] for x in recoveries],
            "target_s": 10.0,
        },
        "steady_state": {
            "plain_step_s_median": statistics.median(plain),
            "elastic_step_s_median": statistics.median(elastic),
            "ratio_of_medians": statistics.median(elastic) / statistics.median(plain),
            "ratio_by_round": [x["ratio"] for x in rounds],
            # The vote itself, timed inside the job (the step-time ratio of two jobs is noisier than it).
            "vote_s_per_step_median": statistics.median(votes),
            "vote_share_of_plain_step": statistics.median(votes) / statistics.median(plain),
            "target_ratio": 1.02,
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("recovery", "steady_state")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
