"""The Strategy API across real replica processes (MirroredStrategy on CPU replicas)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_job

SCRIPT = Path(__file__).parent / "scripts" / "api_mirrored.py"


def _results(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"api_{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("launch", ["self", "phalanx_run"])
@pytest.mark.parametrize("n", [2, 3])
def test_api_across_replicas(tmp_path, n, launch):
    if launch == "self":
        cmd = [sys.executable, str(SCRIPT), str(tmp_path), str(n)]
    else:
        if n == 3:
            pytest.skip("one launcher variant is enough for 3 replicas")
        cmd = [sys.executable, "-m", "phalanx.cli", "run", "-n", str(n), str(SCRIPT), str(tmp_path), str(n)]
    res = run_job(cmd, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.logs()
    results = _results(tmp_path, n)
    for r, got in enumerate(results):
        assert got["rank"] == r and got["num_replicas"] == n and got["chief"] == (r == 0)
        assert got["run_type"] == "PerReplica" and got["local_id"] == r
        assert got["local_ids"] == list(range(n)), "experimental_local_results: every replica of the host"
        # replica r holds [10r, 10r+1, ..., 10r+r]
        values = [10 * k + i for k in range(n) for i in range(k + 1)]
        assert got["sum_axis0"] == pytest.approx(sum(values))
        assert got["mean_axis0"] == pytest.approx(sum(values) / len(values))
        assert got["sum_none"] == sum(range(1, n + 1))
        assert got["mean_none"] == pytest.approx(sum(range(1, n + 1)) / n)
        assert got["nested"] == {"a": got["sum_none"], "b": got["sum_none"]}
        assert got["sum_plain"] == "ContextError"
        assert got["gather"] == values
        assert got["ctx_sum"] == [n, sum(range(n))]
        assert got["ctx_mean"] == pytest.approx(sum(range(n)) / n)
        assert got["ctx_gather"] == [float(k) for k in range(n) for _ in range(2)]
        assert got["merge"] == 100.0 * n
        assert got["values_fn"] == 7 * r
        # 5 rows split near-evenly, then the single last row goes to replica 0, others get nothing
        assert got["dataset_totals"] == [10.0, 5.0]
        assert "Global batch size 1" in got["small_batch"] and str(n) in got["small_batch"]
        assert got["fn_dataset_steps"] == n + 1  # the longest pipeline decides
        assert got["fn_dataset_ctx"] == [n, r]
        assert len(set(got["param_checksum"])) == 1, "replicas diverged"
        assert len(got["extended"][0]) == n
    rows = sorted(v for got in results for s in got["dataset_slices"] for v in s)
    assert rows == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "every sample seen exactly once"
    assert results[1]["dataset_slices"][1] == [], "replicas past the last batch's end get empty slices"
