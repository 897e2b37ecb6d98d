"""``python -m benchmarks.sharded --quick`` (issue 32): the report has every row, and the figures
that are not timings (bytes held, the out-of-memory outcome) meet the issue's targets.

Step times are recorded, never asserted: a 2-core machine shared with other work drifts too much.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import benchmark_module, has_fsdp2, run_job

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("sharded", "fsdp2", "mirrored")


@pytest.mark.skipif(not has_fsdp2(), reason="torch has no FSDP2 (torch < 2.6)")
def test_the_quick_run_reports_memory_step_time_and_the_out_of_memory_job(tmp_path):
    out = tmp_path / "sharded.json"
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = run_job(
        [sys.executable, "-m", "benchmarks.sharded", "--quick", "--out", str(out)],
        timeout=600,
        cwd=tmp_path,
        env={"PYTHONPATH": pythonpath},
    )
    assert result.returncode == 0, result.logs()[-6000:]
    report = json.loads(out.read_text())
    assert report["quick"] and report["machine"]["cpu_model"] and report["global_batch"] == 64
    assert set(report["measure"]) == {"2", "4"}
    cores = len(os.sched_getaffinity(0))
    for n, row in report["measure"].items():
        mem = row["memory_bytes_per_replica"]
        for kind in KINDS:
            assert all(mem[kind][part] > 0 for part in ("params", "grads", "optimizer")), (n, kind, mem)
            assert mem[kind]["total"] == mem[kind]["params"] + mem[kind]["grads"] + mem[kind]["optimizer"]
            assert row["peak_rss_bytes_per_replica"][kind] > mem[kind]["total"]
            assert len(row["samples_per_s"][kind]) == report["rounds"] and min(row["samples_per_s"][kind]) > 0
        # phalanx shards as plain FSDP2 does (each Linear, then the root): the same bytes per replica.
        assert mem["sharded"] == mem["fsdp2"], mem
        assert row["memory_sharded_vs_mirrored"] <= row["memory_target"] == pytest.approx(1.1 / int(n))
        assert row["memory_target_met"]
        for ratio in ("sharded_vs_fsdp2", "sharded_vs_mirrored"):
            assert row[ratio]["min"] <= row[ratio]["median"] <= row[ratio]["max"], row[ratio]
        assert row["oversubscribed"] == (int(n) > cores)
    oom = report["oom"]
    assert oom["replicas"] == 4 and oom["budget_bytes_over_baseline"] == 4 * oom["param_bytes"]
    assert oom["sharded"]["status"] == 0 and oom["fsdp2"]["status"] == 0, oom
    assert oom["mirrored"]["status"] != 0, oom
    assert "can't allocate memory" in oom["mirrored"]["error"], oom["mirrored"]
    assert oom["mirrored"]["where"], oom["mirrored"]
    assert oom["demonstrated"]
    assert "sharded/fsdp2" in result.output and "out of memory" in result.output
    if cores < 4:
        assert "more replicas than cores" in result.output


def test_bad_options_are_refused_before_any_job_starts(capsys):
    bench = benchmark_module("sharded")
    for argv in (["--rounds", "0"], ["--replicas", "1,2"], ["--replicas", "two"], ["--oom", "--skip-oom"]):
        with pytest.raises(SystemExit) as exit_:
            bench.main(argv)
        assert exit_.value.code == 2
        assert "received" in capsys.readouterr().err or "--skip-oom" in argv
