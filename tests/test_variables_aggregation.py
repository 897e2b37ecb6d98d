"""Variables with TF's aggregation and synchronization (issue 28): ``phalanx.Variable`` and ``keras.Variable``.

One job per strategy (tests/scripts/variables_aggregation.py) runs every check on 2 real replica
processes; each test asserts on its part. The expected values are TF 2.21's, from
MirroredStrategy on 2 CPU devices with per-replica values 1.0 and 2.0. The single-process tests
at the end need no job.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx as px
from phalanx.core.distributed_variable import AggregationError, SyncOnReadVariable

import strategies
from conftest import run_job

SCRIPT = Path(__file__).parent / "scripts" / "variables_aggregation.py"
STRATEGIES = ("mirrored_cpu_2", "central_storage_cpu_2", "multi_worker_2")


@pytest.fixture(scope="module", params=STRATEGIES)
def results(request, tmp_path_factory):
    name = request.param
    out = tmp_path_factory.mktemp(name)
    res = run_job(
        strategies.COMBINATIONS[name].command(str(SCRIPT), str(out), name),
        timeout=240,
        cwd=out,
        env={"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.logs()[-6000:]
    return name, [json.loads((out / f"var_{r}.json").read_text()) for r in range(2)]


def _part(results, key):
    name, per_rank = results
    parts = [got[key] for got in per_rank]
    for part in parts:
        assert not (isinstance(part, dict) and "error" in part), part
    return name, parts


def test_on_write_updates_in_run_are_aggregated_on_every_replica(results):
    _, parts = _part(results, "on_write")
    # TF: SUM 3 (or -3), MEAN 1.5, ONLY_FIRST_REPLICA replica 0's 1.0; the returned value is the new one.
    expected = {"SUM": 3.0, "MEAN": 1.5, "ONLY_FIRST_REPLICA": 1.0}
    for got in parts:
        for agg, value in expected.items():
            assert got[f"{agg}/assign_add"] == [value, value]
            assert got[f"{agg}/assign_sub"] == [-value, -value]
            assert got[f"{agg}/assign"] == [value, value]


def test_none_aggregation_raises_on_every_replica_when_values_differ(results):
    _, parts = _part(results, "none_aggregation")
    for got in parts:
        assert got["same"] == 1.0  # the same update everywhere is applied
        assert got["differ"] == {"raised": "AggregationError", "is_value_error": True}
        assert got["differ_value"] == 0.0  # nothing written: the copies stay equal
        assert got["after"] == 2.0  # and the replicas are still in step


def test_python_numbers_are_not_per_replica_values(results):
    _, parts = _part(results, "python_numbers")
    for got in parts:
        assert got["sum"] == {"raised": "AggregationError", "is_value_error": True}  # TF: ValueError
        assert got["mean"] == 1.0
    n = len(parts)  # one record per replica process
    for got in parts:
        assert got["per_replica_numbers"] == sum(range(n)) / n, got  # the same mean on every replica


def test_creation_broadcasts_and_refuses_what_tf_refuses(results):
    _, parts = _part(results, "creation")
    assert parts[0]["random"] == parts[1]["random"]
    for got in parts:
        assert got["int_mean"] == {"raised": "AggregationError", "is_value_error": True}
        assert got["sync_none"] == {"raised": "AggregationError", "is_value_error": True}


def test_on_read_variables_are_combined_when_read_across_replicas(results):
    name, parts = _part(results, "on_read")
    expected = {"SUM": 3.0, "MEAN": 1.5, "ONLY_FIRST_REPLICA": 1.0}
    for rank, got in enumerate(parts):
        for agg, entry in got.items():
            assert entry["trainable"] is False  # TF's default for ON_READ
            assert entry["in_run"] == rank + 1.0  # this replica's own value inside run
            assert entry["reduce_sum"] == 3.0
            # Every replica of this worker: both when the two processes are one host's replicas.
            local = [1.0, 2.0] if entry["num_workers"] == 1 else [rank + 1.0]
            assert entry["local_results"] == local
            if agg == "NONE":
                assert entry["read"] == {"raised": "AggregationError", "is_value_error": True}
            else:
                value = expected[agg]
                assert [entry["read"], entry["float"], entry["numpy"], entry["plus_one"]] == [value] * 3 + [value + 1]


def test_on_read_cross_replica_assign_keeps_the_total(results):
    _, parts = _part(results, "on_read_cross_replica_updates")
    for rank, got in enumerate(parts):
        assert got["sum_local"] == 5.0 and got["sum_read"] == 10.0  # TF: value / num_replicas each
        assert got["sum_assign_add"] == {"raised": "AggregationError", "is_value_error": True}
        assert got["mean_local"] == rank + 2.0 and got["mean_read"] == 2.5


def test_checkpoint_saves_the_combined_value_and_restores_the_total(results):
    _, parts = _part(results, "checkpoint")
    for got in parts:
        assert got == {"saved": 3.0, "local_after_restore": 1.5, "read_after_restore": 3.0}


def test_sum_counter_counts_every_replicas_inputs(results):
    _, parts = _part(results, "counter")
    assert parts == [26.0, 26.0]  # TF's testDatasetOutOfRange


def test_trainable_variable_with_a_torch_optimizer_equals_one_device(results):
    _, parts = _part(results, "trainable")
    assert parts[0]["w0"] == parts[1]["w0"]
    for got in parts:
        assert got["moved"] > 0.1
        assert got["diff"] < 1e-5
    assert parts[0]["checksum"] == parts[1]["checksum"]


def test_keras_variables_in_scope_train_and_aggregate(results):
    _, parts = _part(results, "keras_variables")
    assert parts[0]["w0"] == parts[1]["w0"]
    for got in parts:
        assert got["diff"] < 1e-5
        assert got["seen"] == 8.0 * 3  # SUM over both replicas' slices, 3 steps
        assert got["first"] == 1.0  # only_first_replica: replica 0's value
        assert got["iterations"] == 3  # the optimizer's own only_first_replica variable is not aggregated


def test_keras_on_read_variable(results):
    _, parts = _part(results, "keras_on_read")
    if parts[0] == "keras without synchronization":
        pytest.skip("this Keras has no synchronization argument")
    for rank, got in enumerate(parts):
        assert got == {"in_run": rank + 1.0, "read": 3.0, "numpy": 3.0}


# --------------------------------------------------------------------------- one process


def test_variable_has_tf_variables_surface():
    v = px.Variable(1.0, name="v", aggregation="sum")
    assert (v.name, v.trainable, v.aggregation, v.synchronization) == (
        "v",
        True,
        px.VariableAggregation.SUM,
        px.VariableSynchronization.ON_WRITE,
    )
    assert v.assign_add(2.0) is v and v.assign_sub(1.0, read_value=False) is None
    assert float(v) == 2.0 and v.numpy() == np.float32(2.0) and np.array(v).dtype == np.float32
    assert (v + 1).item() == 3.0 and (3 * v).item() == 6.0 and (-v).item() == -2.0 and bool(v > 1)
    assert v.dtype == torch.float32 and v.shape == () and v.device == torch.device("cpu")
    assert v.read_value().item() == 2.0 and v.value().item() == 2.0
    assert "phalanx.Variable 'v'" in repr(v)
    i = px.Variable([1, 2], dtype="int32", trainable=False)
    assert i.dtype == torch.int32 and not i.requires_grad
    assert px.Variable(lambda: torch.ones(2)).tolist() == [1.0, 1.0]


def test_variable_trains_with_torch_optimizers_and_modules(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the first optimizer step would set it
    v = px.Variable(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([v], lr=0.5)
    (v**2).sum().backward()
    opt.step()
    assert v.tolist() == [0.0, 0.0]
    module = torch.nn.Module()
    module.w = px.Variable(torch.ones(2, 3))
    assert [n for n, _ in module.named_parameters()] == ["w"]
    assert torch.nn.functional.linear(torch.ones(1, 3), module.w).tolist() == [[3.0, 3.0]]


def test_copies_keep_the_variable_type():
    v = px.Variable(1.0, aggregation="mean", synchronization="on_read")
    for c in (copy.deepcopy(v), pickle.loads(pickle.dumps(v))):
        assert isinstance(c, SyncOnReadVariable) and c.aggregation is px.VariableAggregation.MEAN
        assert float(c) == 1.0 and c is not v


def test_bad_arguments_raise_typed_errors():
    with pytest.raises(AggregationError, match="aggregation"):
        px.Variable(1.0, aggregation="average")
    with pytest.raises(AggregationError, match="synchronization"):
        px.Variable(1.0, synchronization="sometimes")
    with pytest.raises(AggregationError, match="shape"):
        px.Variable(torch.zeros(3)).assign(1.0)
    with pytest.raises(AggregationError, match="initial_value"):
        px.Variable()


def test_one_replica_strategies_are_plain():
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        v = px.Variable(0.0, aggregation="sum")
        r = px.Variable(0.0, synchronization="on_read", aggregation="sum")
        m = px.Variable(0, aggregation="mean")  # one replica: TF's refusal is for distributed variables
    assert strategy.extended.variable_created_in_scope(v)  # TF's library-author API knows it
    strategy.run(lambda: (v.assign_add(1.0), r.assign_add(2.0), m.assign_add(3)))
    assert (float(v), float(r), int(m)) == (1.0, 2.0, 3)
    assert strategy.experimental_local_results(r)[0] is r
    assert float(strategy.reduce("SUM", r, axis=None)) == 2.0
    r.assign(5.0)
    assert float(r) == 5.0


def test_enums_accept_tf_and_keras_spellings():
    assert px.VariableAggregation.from_any("only_first_replica") is px.VariableAggregation.ONLY_FIRST_REPLICA
    assert px.VariableAggregation.from_any(None) is px.VariableAggregation.NONE
    assert px.VariableSynchronization.from_any("ON_READ") is px.VariableSynchronization.ON_READ
    assert px.VariableSynchronization.from_any(None) is px.VariableSynchronization.AUTO
