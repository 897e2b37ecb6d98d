"""Step time at 8, 64 and 512 workers, modelled from what ``python -m benchmarks`` measured.

Usage: ``python -m benchmarks.scaling [results/latest.json]`` prints the table in SCALING.md.

Model (weak scaling: every worker keeps its per-replica batch of 128):

* compute: ``t_c`` = one replica's step time without communication (the ``local2`` runs);
* ring all-reduce of ``S`` gradient bytes over ``N`` workers: ``2 (N - 1)`` message hops, each
  costing the per-message latency ``alpha``, and every worker sending ``2 (N - 1) / N * S`` bytes
  at bandwidth ``B``: ``t_ar = 2 (N - 1) alpha + 2 (N - 1) / N * S / B``;
* overlap: buckets are reduced during backward, so up to ``f = 2/3`` of ``t_c`` (the backward
  share) can hide communication: ``t_step = t_c + max(0, t_ar - f * t_c)``.

``alpha`` and ``B`` come from the measured all-reduce rows (smallest size for latency, largest for
bandwidth). Over a real network replace them with the NIC's figures (``--alpha-us``, ``--bw-gbps``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GRAD_BYTES = {
    "seed_mlp": (784 * 128 + 128 + 128 * 10 + 10) * 4,
    "large_mlp": (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10) * 4,
    "cnn": (16 * 9 + 16 + 32 * 16 * 9 + 32 + 32 * 49 * 10 + 10) * 4,
}
BACKWARD_SHARE = 2 / 3


def step_time(t_c: float, grad_bytes: int, n: int, alpha: float, bw: float) -> tuple[float, float]:
    t_ar = 2 * (n - 1) * alpha + 2 * (n - 1) / n * grad_bytes / bw
    return t_c + max(0.0, t_ar - BACKWARD_SHARE * t_c), t_ar


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report", nargs="?", default=str(Path(__file__).parent / "results" / "latest.json"))
    parser.add_argument("--alpha-us", type=float, default=None, help="per-hop latency (default: measured)")
    parser.add_argument("--bw-gbps", type=float, default=None, help="per-worker bandwidth (default: measured)")
    parser.add_argument("--impl", default="gloo", choices=["gloo", "phalanx"], help="which measured all-reduce")
    args = parser.parse_args()
    report = json.loads(Path(args.report).read_text())
    rows = report["allreduce"]["rows"]
    # a 2-process all-reduce is 2 hops: latency per hop = half the small-message time
    alpha = (args.alpha_us * 1e-6) if args.alpha_us else rows[0][f"{args.impl}_us"] * 1e-6 / 2
    bw = (args.bw_gbps * 1e9) if args.bw_gbps else rows[-1][f"{args.impl}_busbw_gbps"] * 1e9
    print(f"alpha = {alpha * 1e6:.0f} us per hop, B = {bw / 1e9:.2f} GB/s ({args.impl})")
    print(f"{'model':<10}{'grad MB':>8}{'t_c ms':>8} | " + " | ".join(f"N={n}: step ms, eff" for n in (8, 64, 512)))
    for model, per_s in report["throughput"]["samples_per_s"].items():
        local = sorted(per_s["local2"])[len(per_s["local2"]) // 2]
        t_c = 128 / (local / 2)  # each of the 2 independent processes trains batch 128
        cells = []
        for n in (8, 64, 512):
            t, _ = step_time(t_c, GRAD_BYTES[model], n, alpha, bw)
            cells.append(f"{t * 1e3:9.1f} {t_c / t:5.0%}")
        print(f"{model:<10}{GRAD_BYTES[model] / 1e6:8.2f}{t_c * 1e3:8.2f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
