"""The Strategy API across real replica processes (MirroredStrategy on CPU replicas).

One job per configuration (``scripts/api_mirrored.py`` writes what each replica saw) feeds many
named checks, so a failure names the property that broke and does not hide the others.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import strategies
from conftest import run_job

SCRIPT = Path(__file__).parent / "scripts" / "api_mirrored.py"

# (replicas, launcher): self-launch for 2 and 3 replicas, `phalanx run` for 2.
CONFIGS = [(2, "self"), (3, "self"), (2, "phalanx_run")]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{n}-{launch}" for n, launch in CONFIGS])
def api(request, tmp_path_factory):
    """(n, per-replica results) of one run of the script."""
    n, launch = request.param
    out = tmp_path_factory.mktemp(f"api-{n}-{launch}")
    combination = strategies.Combination(f"mirrored_cpu_{n}", strategies.mirrored_cpu, n, launch=launch)
    res = run_job(combination.command(str(SCRIPT), str(out), str(n)), timeout=120, cwd=out)
    assert res.returncode == 0, res.logs()
    return n, [json.loads((out / f"api_{r}.json").read_text()) for r in range(n)]


def _uneven_values(n: int) -> list[int]:
    # replica r holds [10r, 10r+1, ..., 10r+r]
    return [10 * k + i for k in range(n) for i in range(k + 1)]


def test_identity_and_run_values(api):
    n, results = api
    for r, got in enumerate(results):
        assert got["rank"] == r and got["num_replicas"] == n and got["chief"] == (r == 0)
        assert got["run_type"] == "PerReplica" and got["local_id"] == r
        assert got["local_ids"] == list(range(n)), "experimental_local_results: every replica of the host"


def test_public_process_identity_outside_scope(api):
    n, results = api
    for r, got in enumerate(results):
        assert got["identity"] == [r, n, r == 0]


def test_reduce_with_axis_handles_uneven_lengths(api):
    n, results = api
    values = _uneven_values(n)
    for got in results:
        assert got["sum_axis0"] == pytest.approx(sum(values))
        assert got["mean_axis0"] == pytest.approx(sum(values) / len(values))


def test_reduce_without_axis(api):
    n, results = api
    for got in results:
        assert got["sum_none"] == sum(range(1, n + 1))
        assert got["mean_none"] == pytest.approx(sum(range(1, n + 1)) / n)
        assert got["nested"] == {"a": got["sum_none"], "b": got["sum_none"]}


def test_sum_of_a_plain_value_is_refused(api):
    _, results = api
    assert all(got["sum_plain"] == "NonDistributedValueError" for got in results)


def test_gather_handles_uneven_lengths(api):
    n, results = api
    assert all(got["gather"] == _uneven_values(n) for got in results)


def test_replica_context_collectives(api):
    n, results = api
    for got in results:
        assert got["ctx_sum"] == [n, sum(range(n))]
        assert got["ctx_mean"] == pytest.approx(sum(range(n)) / n)
        assert got["ctx_gather"] == [float(k) for k in range(n) for _ in range(2)]
        assert got["merge"] == 100.0 * n


def test_values_from_function(api):
    _, results = api
    for r, got in enumerate(results):
        assert got["values_fn"] == 7 * r


def test_distributed_dataset_splits_batches_and_keeps_every_row(api):
    _, results = api
    for got in results:
        # 5 rows split near-evenly, then the single last row goes to replica 0, others get nothing
        assert got["dataset_totals"] == [10.0, 5.0]
    rows = sorted(v for got in results for s in got["dataset_slices"] for v in s)
    assert rows == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "every sample seen exactly once"
    assert results[1]["dataset_slices"][1] == [], "replicas past the last batch's end get empty slices"


def test_first_batch_smaller_than_the_replica_count_is_split_as_tf_with_a_warning(api):
    # TF's testDatasetDistributeNotDivisibleDrop: replica 0 gets the one example, the others none.
    n, results = api
    for r, got in enumerate(results):
        assert got["small_batch"]["rows"] == [1 if r == 0 else 0]
        assert any(f"1 example(s) for {n} replicas" in w for w in got["small_batch"]["warnings"]), got["small_batch"]


def test_datasets_from_function_run_until_the_longest_pipeline_ends(api):
    n, results = api
    for r, got in enumerate(results):
        assert got["fn_dataset_steps"] == n + 1  # the longest pipeline decides
        assert got["fn_dataset_ctx"] == [n, r]


def test_replicas_stay_identical_through_training(api):
    n, results = api
    for got in results:
        assert len(set(got["param_checksum"])) == 1, "replicas diverged"
        assert len(got["extended"][0]) == n


def test_the_public_extended_contract(api):
    n, results = api
    for r, got in enumerate(results):
        c = got["contract"]
        assert c["process_index"] == c["replica_id"] == r and c["num_replicas_in_sync"] == n
        assert c["device"] == "cpu" and c["step"] > 0
        assert c["broadcast"] == float(n - 1)
        assert c["all_reduce"] == float(sum(range(n)))
        assert c["all_gather"] == [float(k) for k in range(n) for _ in range(k + 1)]
