"""TF's rules for values on 2 real replica processes: plain ("host") tensors, integer means,
gradients through the replica context's collectives, and TF's regroup check (issue 28).

One job per strategy (tests/scripts/tf_values.py) runs every check; each test asserts on its part.
Under MirroredStrategy both replicas are one worker; under MultiWorkerMirroredStrategy 2x1 each
is its own worker, where TF reduces a plain tensor across the workers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import free_ports, run_job, run_jobs, tf_config

SCRIPT = Path(__file__).parent / "scripts" / "tf_values.py"
ENV = {"OMP_NUM_THREADS": "1", "PHALANX_COLLECTIVE_TIMEOUT": "30"}


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    out = tmp_path_factory.mktemp("values_m")
    res = run_job([sys.executable, str(SCRIPT), str(out), "mirrored"], timeout=180, cwd=out, env=ENV)
    assert res.returncode == 0, res.logs()[-6000:]
    return [json.loads((out / f"values_{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def mwms(tmp_path_factory):
    out = tmp_path_factory.mktemp("values_w")
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    jobs = [([sys.executable, str(SCRIPT), str(out), "mwms"], {**ENV, **tf_config(workers, i)}) for i in range(2)]
    results = run_jobs(jobs, timeout=180, cwd=out)
    for r in results:
        assert r.returncode == 0, r.output[-6000:]
    return [json.loads((out / f"values_{r}.json").read_text()) for r in range(2)]


def _ok(value):
    assert not (isinstance(value, dict) and "error" in value), value
    return value


def _error(value, kind):
    assert isinstance(value, dict) and "error" in value, f"expected {kind}, got {value!r}"
    assert kind in value["bases"], value
    return value


# ------------------------------------------------------------------ host tensors (TF: one value per worker)
def test_sum_of_a_plain_tensor_on_one_worker_is_a_value_error_everywhere(mirrored):
    for got in mirrored:
        # TF: cross_device_ops.reduce_non_distributed_value raises ValueError; so do reduce_to.
        _error(got["host_sum"], "ValueError")
        assert got["host_sum"]["error"] == "NonDistributedValueError"
        _error(got["host_reduce_to_sum"], "ValueError")


def test_mean_returns_a_plain_tensor_and_zeros_sum_to_zeros(mirrored):
    for got in mirrored:
        assert _ok(got["host_mean"]) == [1.0, 2.0]
        assert _ok(got["host_zeros_sum"]) == [0.0, 0.0]


def test_gather_of_a_plain_tensor_on_one_worker_is_the_tensor(mirrored):
    # TF's MirroredExtended._gather_to_implementation returns a non-distributed value itself.
    assert [_ok(g["host_gather"]) for g in mirrored] == [[0.0, 7.0], [1.0, 7.0]]


def test_reduce_along_an_axis_treats_a_plain_tensor_as_per_replica(mirrored):
    for got in mirrored:
        assert _ok(got["host_sum_axis"]) == 6.0  # TF: run(reduce_sum) on 2 replicas, then SUM


def test_mixed_structure_reduces_each_leaf_by_its_rule(mirrored):
    for got in mirrored:
        assert _ok(got["mixed"]) == {"per": 1.5, "host": 3.0}


def test_plain_tensors_reduce_across_workers(mwms):
    # TF strategy_common_test StrategyReduceTest.testReduceHostTensor: SUM of 1.0 on 2 workers is 2.0.
    for got in mwms:
        assert _ok(got["host_sum"]) == 2.0
        assert _ok(got["host_reduce_to_sum"]) == 2.0
        assert _ok(got["host_mean"]) == [1.0, 2.0]
    # Gathered across the workers: each worker's own tensor.
    assert [_ok(g["host_gather"]) for g in mwms] == [[0.0, 7.0, 1.0, 7.0]] * 2


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("job", ["mirrored", "mwms"])
def test_mean_of_integers_is_float64_as_tf_true_division(job, request):
    for got in request.getfixturevalue(job):
        assert _ok(got["int_mean"]) == ["torch.float64", [1.5], "torch.float64", 1.5]
        assert _ok(got["replica_int_mean"]) == ["torch.float64", 1.5]


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize("job", ["mirrored", "mwms"])
def test_all_reduce_is_differentiable_with_tfs_gradients(job, request):
    # TF strategy_test_lib: inputs c = [1., 3.], expected grads SUM [4., 4.], MEAN [2., 2.]; the local
    # results of a worker: both replicas under Mirrored, its one replica under MultiWorkerMirrored 2x1.
    per_worker = 2 if job == "mirrored" else 1
    for got in request.getfixturevalue(job):
        assert _ok(got["grad_sum"]) == [4.0] * per_worker
        assert _ok(got["grad_mean"]) == [2.0] * per_worker


def test_all_gather_is_differentiable_with_tfs_gradients(mirrored):
    # Gathered [x0 | x1 x1]; loss_r = sum(g * w * (r + 1)) with w = [1, 2, 3]: d/dx = sum over r of the
    # weights at x's positions = 3 * w[pos].
    assert _ok(mirrored[0]["grad_gather"]) == [3.0]
    assert _ok(mirrored[1]["grad_gather"]) == [6.0, 9.0]


def test_a_forward_pass_that_all_reduces_trains_as_on_one_device(mirrored):
    for got in mirrored:
        trained, one_device = _ok(got["global_statistic_trains"])
        assert trained == pytest.approx(one_device, abs=1e-6)
        assert trained != pytest.approx([0.0, 0.0, 0.0])


# ------------------------------------------------------------------ regroup
@pytest.mark.parametrize(
    "case, mine, theirs",
    [
        ("structure_reduce", "(Tensor, Tensor)", "(Tensor,)"),
        ("structure_dict_gather", "{a: Tensor}", "{b: Tensor}"),
        ("structure_none_local_results", "Tensor", "None"),
    ],
)
def test_different_structures_from_run_are_one_error_on_every_replica(mirrored, case, mine, theirs):
    for got in mirrored:
        err = _error(got[case], "ValueError")
        assert err["error"] == "RunStructureMismatchError", err
        assert f"replica 0: {mine}" in err["text"] and f"replica 1: {theirs}" in err["text"], err["text"]


def test_batches_of_different_lengths_are_the_same_structure(mirrored):
    for got in mirrored:
        assert _ok(got["structure_same_shapes_differ"]) == [1.0, 1.0, 1.0]


def test_replicas_stay_in_step_after_the_errors(mirrored):
    for got in mirrored:
        assert _ok(got["after_errors_the_replicas_are_in_step"]) == 1.0
