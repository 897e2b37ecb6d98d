"""Per-replica diagnostics of a benchmark job (issue 33): what each replica of a real job records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import run_job

ROOT = Path(__file__).resolve().parent.parent


def test_a_job_records_each_replicas_time_cpu_and_waits(tmp_path):
    diag = tmp_path / "diag"
    out = tmp_path / "out.json"
    run_job(
        [sys.executable, "-m", "benchmarks.worker", "px_mirrored", "seed_mlp", str(out), "--seconds", "0.3"],
        timeout=240,
        cwd=ROOT,
        log_dir=tmp_path / "logs",  # not the repository's
        env={"PHALANX_BENCH_DIAG": str(diag), "PYTHONPATH": str(ROOT)},
    )
    assert json.loads(out.read_text())["samples_per_s"] > 0
    replicas = sorted((json.loads(p.read_text()) for p in diag.glob("replica-*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in replicas] == [0, 1], list(diag.iterdir())
    for r in replicas:
        assert r["config"] == "px_mirrored" and r["steps"] == len(r["step_times_ms"]) == len(r["cpu_per_step"]) > 0
        assert 0.25 <= r["wall_s"] < 60 and r["user_s"] + r["sys_s"] > 0, r
        assert 0 < r["main_run_s"] <= r["wall_s"] + 0.05 and r["main_runqueue_s"] >= 0, r
        assert sum(r["cpus"].values()) == r["steps"] and r["nvcsw"] >= 0 and r["nivcsw"] >= 0, r
        assert r["step_median_ms"] <= r["step_p90_ms"] <= r["step_max_ms"], r
    assert replicas[0]["pid"] != replicas[1]["pid"]
    # The replicas' shared-memory communicator wrote its wait statistics at close.
    shm = sorted(json.loads(p.read_text())["rank"] for p in diag.glob("shm-*.json"))
    assert shm == [0, 1], list(diag.iterdir())
