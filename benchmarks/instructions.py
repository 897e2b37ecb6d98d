"""Host instructions per training step at world size 1, phalanx against DDP: the CPU proxy, counted.

Usage: ``python -m benchmarks.instructions [--model M] [--steps 20] [--configs a,b,...] [--out FILE.json]``

``benchmarks/hooks.py`` times the configurations; on a shared 2-core VM its figures move by tens of
percent with whatever else runs. This counts instead: each configuration runs in its own process
under valgrind's callgrind, which counts the instructions the host executes (the same count for the
same program, whatever the load), collected only while ``--steps`` training steps run after a
warm-up (``--toggle-collect`` on the C function that drives the loop, ``functools.reduce``). Work
in other threads (gloo's) is not counted; waiting costs no instructions. What a GPU step loses to
the distribution layer is host work, so fewer instructions is the goal on both.

The report gives instructions per step for each configuration and the **gradient path**: what
phalanx adds over one replica without collectives, ``px_ws1 - px_mirrored``, against what DDP adds
over the plain loop, ``ddp_ws1 - raw`` (as in ``benchmarks/hooks.py``; below 1.0: phalanx does
less host work). Needs valgrind (``apt-get install valgrind``); a configuration takes about
90 s (most of it importing torch under valgrind).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
import sys
import warnings

from benchmarks.hooks import CONFIGS


def child(config: str, model: str, steps: int, batch: int | None) -> None:
    """Builds one configuration, warms it up, then runs ``steps`` steps inside ``functools.reduce``."""
    import torch

    from benchmarks.hooks import configs

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    step = configs("cpu", model, batch, only=(config,))[config]
    for _ in range(10):  # first-step checks, the fingerprint, allocator and caches
        step()
    functools.reduce(lambda acc, _: step(), range(steps), None)  # the counted loop


def count(config: str, model: str, steps: int, batch: int | None) -> int:
    """Instructions executed by ``steps`` steps of ``config`` (callgrind's ``Collected``)."""
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--toggle-collect=functools_reduce",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-m",
        "benchmarks.instructions",
        "--child",
        config,
        "--model",
        model,
        "--steps",
        str(steps),
    ]
    if batch:
        cmd += ["--batch", str(batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"{config}: valgrind run failed ({out.returncode})\n{out.stderr[-3000:]}")
    return int(found.group(1))


def summary(per_step: dict[str, float]) -> dict:
    out: dict = {"instructions_per_step": per_step}
    if all(c in per_step for c in ("raw", "ddp_ws1", "px_mirrored", "px_ws1")):
        ddp = per_step["ddp_ws1"] - per_step["raw"]
        px = per_step["px_ws1"] - per_step["px_mirrored"]
        out["gradient_path"] = {"ddp": ddp, "phalanx": px, "phalanx_vs_ddp": px / ddp if ddp > 0 else None}
        if "px_ws1_noguard" in per_step:
            guard = per_step["px_ws1"] - per_step["px_ws1_noguard"]
            out["gradient_path"]["guard"] = guard
            out["gradient_path"]["phalanx_without_guard_vs_ddp"] = (px - guard) / ddp if ddp > 0 else None
    return out


def main(argv: list[str] | None = None) -> dict | None:
    from benchmarks.models import EXTRA_MODELS, MODELS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS + EXTRA_MODELS, default="transformer_small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.model, args.steps, args.batch)
        return None
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    from benchmarks.__main__ import machine

    per_step = {}
    for config in args.configs.split(","):
        per_step[config] = count(config, args.model, args.steps, args.batch) / args.steps
        print(f"{config:16s} {per_step[config] / 1e6:8.3f} M instructions/step", flush=True)
    result = {"model": args.model, "steps": args.steps, "machine": machine("cpu"), **summary(per_step)}
    path = result.get("gradient_path")
    if path:
        print(
            f"gradient path: phalanx {path['phalanx'] / 1e6:.3f} M, DDP {path['ddp'] / 1e6:.3f} M "
            f"(phalanx / DDP {path['phalanx_vs_ddp']:.2f})"
        )
        if "guard" in path:
            print(
                f"the guard: {path['guard'] / 1e6:.3f} M; without it phalanx / DDP "
                f"{path['phalanx_without_guard_vs_ddp']:.2f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
