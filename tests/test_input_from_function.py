"""``distribute_datasets_from_function`` gives TF's result (issue 28, class 8), and InputContext's str.

One job per strategy (tests/scripts/input_from_function.py) runs every check; each test asserts on
its part. The expected values are what TensorFlow 2.21 (CPU) gives for the same program:
MirroredStrategy over two logical CPU devices (``tf.config.set_logical_device_configuration``) and
MultiWorkerMirroredStrategy with two one-replica workers under TF_CONFIG. TF calls ``dataset_fn``
once per worker (tensorflow/python/distribute/input_lib.py,
``_create_datasets_from_function_with_input_context``) and its multi-device iterator feeds the
worker's replicas the pipeline's elements in turn.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import phalanx as px

from conftest import free_ports, run_job, run_jobs, tf_config

SCRIPT = Path(__file__).parent / "scripts" / "input_from_function.py"
ENV = {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
ONE_WORKER = ("mirrored", "central")


def _read(out: Path) -> list[dict]:
    return [json.loads((out / f"fn_{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """``kind -> [results of replica 0, of replica 1]``; each job runs on first use."""
    done: dict[str, list[dict]] = {}

    def get(kind: str) -> list[dict]:
        if kind in done:
            return done[kind]
        out = tmp_path_factory.mktemp(kind)
        if kind == "mwms":
            workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
            cmd = [sys.executable, str(SCRIPT), str(out), kind]
            results = run_jobs([(cmd, {**ENV, **tf_config(workers, i)}) for i in range(2)], timeout=240, cwd=out)
            assert all(r.returncode == 0 for r in results), [r.output[-4000:] for r in results]
        else:
            res = run_job([sys.executable, str(SCRIPT), str(out), kind], timeout=240, cwd=out, env=ENV)
            assert res.returncode == 0, res.logs()[-6000:]
        done[kind] = _read(out)
        return done[kind]

    return get


def _ok(value):
    assert not (isinstance(value, dict) and "error" in value), value
    return value


def _ranges(*bounds: tuple[int, int]) -> list[list[int]]:
    return [list(range(a, b)) for a, b in bounds]


@pytest.mark.parametrize("kind", [*ONE_WORKER, "mwms"])
def test_dataset_fn_is_called_once_per_worker_with_tfs_context(jobs, kind):
    for rank, got in enumerate(jobs(kind)):
        # TF: num_input_pipelines = the number of workers, input_pipeline_id = the worker's index.
        expected = [[1, 0, 2]] if kind in ONE_WORKER else [[2, rank, 2]]
        assert _ok(got["contexts"]) == expected


@pytest.mark.parametrize("kind", ONE_WORKER)
def test_a_worker_pipeline_feeds_its_replicas_in_turn(jobs, kind):
    # TF 2.21, MirroredStrategy x2, range(16).batch(4): step 0 gives replica 0 [0..3] and replica 1
    # [4..7], step 1 [8..11] and [12..15]: disjoint batches covering every element once.
    r0, r1 = (_ok(got["nonshard"]) for got in jobs(kind))
    assert r0 == _ranges((0, 4), (8, 12))
    assert r1 == _ranges((4, 8), (12, 16))


@pytest.mark.parametrize("kind", ONE_WORKER)
def test_an_uneven_end_gives_the_replicas_past_it_empty_batches(jobs, kind):
    r0, r1 = (_ok(got["uneven"]) for got in jobs(kind))
    # TF 2.21: range(20).batch(4) -> [[0..3], [4..7]], [[8..11], [12..15]], [[16..19], []].
    assert r0["20"] == _ranges((0, 4), (8, 12), (16, 20))
    assert r1["20"] == [*_ranges((4, 8), (12, 16)), []]
    # range(18): the last batch is partial; range(4): one batch, replica 1 gets an empty one.
    assert r0["18"] == [*_ranges((0, 4), (8, 12)), [16, 17]]
    assert r1["18"] == [*_ranges((4, 8), (12, 16)), []]
    assert (r0["4"], r1["4"]) == ([[0, 1, 2, 3]], [[]])


@pytest.mark.parametrize("kind", ONE_WORKER)
def test_average_loss_divides_by_the_examples_of_the_step(jobs, kind):
    r0, r1 = (_ok(got["average_loss"]) for got in jobs(kind))
    assert r0 == [0.5, 0.5, 1.0]
    assert r1 == [0.5, 0.5, 0.0]


@pytest.mark.parametrize("kind", ONE_WORKER)
def test_unbatched_elements_give_each_replica_one_element_per_step(jobs, kind):
    r0, r1 = (_ok(got["unbatched"]) for got in jobs(kind))
    # TF 2.21, Dataset.range(5) unbatched on one worker: steps [0, 1], [2, 3]; the element left
    # over (4) is dropped, because scalar elements are statically shaped (no partial step).
    for key in ("tensors", "ints"):
        assert (r0[key], r1[key]) == ([0, 2], [1, 3]), key
    assert (r0["sharded"], r1["sharded"]) == ([0, 2, 4, 6, 8], [1, 3, 5, 7, 9])
    assert r0["dicts"] == [{"a": 0, "b": 0.0}, {"a": 2, "b": 4.0}]
    assert r1["dicts"] == [{"a": 1, "b": 2.0}, {"a": 3, "b": 6.0}]


def test_multi_worker_each_worker_pipeline_feeds_its_replica(jobs):
    # TF 2.21, MultiWorkerMirroredStrategy, 2 workers x 1 replica under TF_CONFIG: each worker's
    # own pipeline, all of it, to its one replica.
    for rank, got in enumerate(jobs("mwms")):
        assert _ok(got["nonshard"]) == _ranges((0, 4), (4, 8), (8, 12), (12, 16))
        assert _ok(got["uneven"])["18"] == [*_ranges((0, 4), (4, 8), (8, 12), (12, 16)), [16, 17]]
        unbatched = _ok(got["unbatched"])
        assert unbatched["tensors"] == unbatched["ints"] == [0, 1, 2, 3, 4]
        assert unbatched["sharded"] == list(range(rank, 10, 2))
        assert _ok(got["per_replica"])["contexts"] == [[2, rank, 2]]
        assert got["mismatch"] == "no error", "workers' pipelines may differ"
    # TF 2.21, worker w reading range(4 + w) unbatched: replica 0 gets a dummy 0 at the last step
    # (across workers TF feeds dummies even for scalars); range(16 + 4w).batch(4): an empty batch.
    r0, r1 = (_ok(got["uneven_workers"]) for got in jobs("mwms"))
    assert (r0["scalars"], r1["scalars"]) == ([0, 1, 2, 3, 0], [0, 1, 2, 3, 4])
    assert r0["batches"] == [*_ranges((0, 4), (4, 8), (8, 12), (12, 16)), []]
    assert r1["batches"] == _ranges((0, 4), (4, 8), (8, 12), (12, 16), (16, 20))


@pytest.mark.parametrize("kind", ONE_WORKER)
def test_one_worker_unbatched_end_drops_the_partial_step(jobs, kind):
    r0, r1 = (_ok(got["uneven_workers"]) for got in jobs(kind))
    # One pipeline, range(4): [0, 1], [2, 3]; range(16).batch(4): [0..3] | [4..7], [8..11] | [12..15].
    assert (r0["scalars"], r1["scalars"]) == ([0, 2], [1, 3])
    assert (r0["batches"], r1["batches"]) == (_ranges((0, 4), (8, 12)), _ranges((4, 8), (12, 16)))


@pytest.mark.parametrize("kind", ONE_WORKER)
def test_per_replica_pipelines_stay_available_as_an_option(jobs, kind):
    for rank, got in enumerate(jobs(kind)):
        per_replica = _ok(got["per_replica"])
        # TF 2.21, InputReplicationMode.PER_REPLICA: dataset_fn once per replica, each replica
        # fed its own pipeline (here the same, unsharded data).
        assert per_replica["contexts"] == [[2, rank, 2]]
        assert per_replica["batches"] == _ranges((0, 4), (4, 8), (8, 12), (12, 16))


@pytest.mark.parametrize("kind", ONE_WORKER)
def test_unseeded_shuffling_pipeline_is_the_same_stream_on_every_process(jobs, kind):
    results = jobs(kind)
    for got in results:
        epochs = _ok(got["shuffle"])["epochs"]
        for rows in epochs:
            assert sorted(v for step in rows for v in step) == [float(i) for i in range(32)]
        assert epochs[0] != epochs[1], "each epoch is shuffled anew"
        rows = _ok(got["random_data"])
        assert len(rows) == 2 and len({tuple(r) for step in rows for r in step}) == 4
    assert results[0]["shuffle"]["own_random"] != results[1]["shuffle"]["own_random"]


@pytest.mark.parametrize("kind", ONE_WORKER)
def test_processes_reading_different_streams_are_detected(jobs, kind):
    for got in jobs(kind):
        assert got["mismatch"]["error"] == "InputMismatchError", got["mismatch"]


@pytest.mark.parametrize("kind", ["mirrored", "mwms"])
def test_distribute_dataset_refuses_unbatched_elements_with_tfs_error_type(jobs, kind):
    for got in jobs(kind):
        refused = _ok(got["distribute_dataset_unbatched"])
        assert refused != "no error"
        # TF 2.21: experimental_distribute_dataset(Dataset.range(8)) raises IndexError.
        assert refused["index_error"], refused


def test_input_and_value_context_str_as_tf():
    ctx = px.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    # TF: "tf.distribute.InputContext(input pipeline id 1, total: 2)" (distribute_lib.InputContext.__str__)
    assert str(ctx) == repr(ctx) == "phalanx.InputContext(input pipeline id 1, total: 2)"
    value = px.experimental.ValueContext(1, 2)
    # TF: "tf.distribute.ValueContext(replica id 1,  total replicas in sync: 2)" (its spacing)
    assert str(value) == repr(value) == "phalanx.ValueContext(replica id 1,  total replicas in sync: 2)"
    assert px.InputContext(1, 0, 1) == px.InputContext(1, 0, 1)


def test_replication_modes_are_tfs():
    assert {m.name for m in px.InputReplicationMode} == {"PER_WORKER", "PER_REPLICA"}
    assert px.InputOptions().experimental_replication_mode is px.InputReplicationMode.PER_WORKER
