"""TF semantics that ported programs rely on, across 2 real replica processes (issue 16).

One job (tests/scripts/tf_semantics.py) runs every check; each test asserts on its part.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_job

SCRIPT = Path(__file__).parent / "scripts" / "tf_semantics.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sem")
    res = run_job(
        [sys.executable, str(SCRIPT), str(out)],
        timeout=180,
        cwd=out,
        env={"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.logs()[-6000:]
    return [json.loads((out / f"sem_{r}.json").read_text()) for r in range(2)]


def _ok(value):
    assert not (isinstance(value, dict) and "error" in value), value
    return value


def test_local_results_give_every_row_of_the_ordering_recipe(results):
    for got in results:
        rows = {int(k): v for k, v in _ok(got["ordering"]).items()}
        assert rows == {i: 2 * i for i in range(24)}, "the input tutorial's ordering recipe lost rows"


def test_unseeded_shuffling_loader_gives_the_same_global_batches_everywhere(results):
    for got in results:
        epochs = _ok(got["shuffle"])["epochs"]
        for rows in epochs:
            # Every example exactly once per epoch: the processes sliced the same global batches.
            assert sorted(v for batch in rows for v in batch) == [float(i) for i in range(32)]
        assert epochs[0] != epochs[1], "each epoch is shuffled anew"
    assert results[0]["shuffle"]["own_random"] != results[1]["shuffle"]["own_random"], (
        "each process's own random state must be given back"
    )


def test_lazily_shuffling_generator_gives_the_same_global_batches(results):
    for got in results:
        batches = _ok(got["lazy_shuffle"])
        assert len(batches) == 4
        for b in batches:  # each global batch is one batch, the same in both processes: 4 distinct rows
            assert len(set(b)) == 4, b
    assert results[0]["lazy_shuffle"] == results[1]["lazy_shuffle"]


def test_mismatched_global_batches_are_detected(results):
    for got in results:
        assert got["mismatch"]["error"] == "InputMismatchError", got["mismatch"]


def test_lazy_model_in_run_stays_identical_and_metrics_are_global(results):
    lazy = [_ok(got["lazy_model"]) for got in results]
    for got in lazy:
        assert got["checksums"][0] == got["checksums"][1], "a model built inside run drifted apart"
    # result() is the same on both replicas: the metric over all 64 examples of 4 steps...
    assert lazy[0]["accuracy"] == lazy[1]["accuracy"]
    assert lazy[0]["mean_loss"] == pytest.approx(lazy[1]["mean_loss"])
    # ...while each replica's own state (its half: 32 examples) is left as it was.
    assert [g["local_count"] for g in lazy] == [32.0, 32.0]
    assert [g["count_after"] for g in lazy] == [32.0, 32.0]


def test_keras_save_writes_once_and_returns_when_complete(results):
    for got in results:
        assert _ok(got["save"]) == "ok"


def test_reduce_to_batch_reduce_to_update(results):
    for got in results:
        r = _ok(got["reduce_to"])
        assert r["sum"] == [2.0, 1.0] and r["mean"] == [1.0, 0.5] and r["v"] == [2.0, 1.0]
        assert r["created"] and not r["outside"]
