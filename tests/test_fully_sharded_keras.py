"""Keras compile / fit / evaluate / predict under FullyShardedStrategy (issue 32).

Two replicas train the same programs as one-device Keras: SGD with momentum and L2 with a last
batch split unequally, Adam on a model with an Embedding and validation_split, AdamW with
BatchNormalization after set_weights. The weights, History, evaluate and predict must equal
one-device Keras; each replica must hold half of the trainable weights and of the optimizer's
slots; ``model.save`` must write a file plain Keras loads; a phalanx Checkpoint must move between
one device and the shards, optimizer slots included; a callback that would read the weights
on the chief alone is refused with a typed error instead of waiting forever.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import has_fsdp2, run_job

pytestmark = [
    pytest.mark.skipif(not has_fsdp2(), reason="torch has no FSDP2 (torch < 2.6)"),
    pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="Keras is not installed"),
]

SCRIPT = Path(__file__).parent / "scripts" / "sharded_keras.py"
ENV = {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
EXACT = ["sgd", "adam"]


def _keras_version() -> tuple[int, ...]:
    return tuple(int(p) for p in importlib.metadata.version("keras").split(".")[:2])


OLD_KERAS = importlib.util.find_spec("keras") is not None and _keras_version() < (3, 7)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded_keras")
    for mode in ("reference", "sharded") if OLD_KERAS else ("reference", "sharded", "plain"):
        res = run_job([sys.executable, str(SCRIPT), str(out), mode], timeout=240, cwd=out, env=ENV)
        assert res.returncode == 0, res.logs()[-8000:]
    return out


@pytest.fixture(scope="module")
def out(job) -> Path:
    if OLD_KERAS:
        pytest.skip("Keras < 3.7: sharding a Keras model is refused (test_old_keras_is_refused_typed)")
    return job


@pytest.mark.skipif(not OLD_KERAS, reason="Keras >= 3.7 shards Keras models")
def test_old_keras_is_refused_typed(job):
    for rank in (0, 1):
        assert "needs Keras >= 3.7" in (job / f"old_keras_refused_{rank}.txt").read_text()


@pytest.mark.parametrize("case", EXACT)
def test_fit_evaluate_predict_equal_one_device_keras(out, case):
    ref, got = np.load(out / f"reference_{case}.npz"), np.load(out / f"sharded_{case}.npz")
    assert ref.files == got.files
    for key in ref.files:  # every weight (get_weights, gathered) and the predictions
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
    ref_logs = json.loads((out / f"reference_{case}.json").read_text())
    got_logs = json.loads((out / f"sharded_{case}.json").read_text())
    for key, values in ref_logs["history"].items():
        np.testing.assert_allclose(got_logs["history"][key], values, rtol=1e-5, err_msg=key)
    for key, value in ref_logs["evaluate"].items():
        assert got_logs["evaluate"][key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize("case", [*EXACT, "adamw_batchnorm"])
def test_each_replica_holds_half_of_the_weights_and_slots(out, case):
    whole = json.loads((out / f"reference_{case}_local_0.json").read_text())
    assert whole["weights"] == whole["whole"] > 0
    for rank in (0, 1):
        local = json.loads((out / f"sharded_{case}_local_{rank}.json").read_text())
        assert local["whole"] == whole["whole"]
        # Rows are split: at most one row more than half (a weight with an odd first dimension).
        assert local["weights"] <= 0.5 * whole["weights"] * 1.1, local
        assert local["slots"] <= 0.5 * whole["slots"] * 1.1, local


def test_batchnorm_model_trains_with_whole_statistics_and_set_weights_holds(out):
    # The script asserts that set_weights' values read back and that the replicas' weights
    # (statistics included) agree after fit; here: it finished and learned something sane.
    logs = json.loads((out / "sharded_adamw_batchnorm.json").read_text())
    ref = json.loads((out / "reference_adamw_batchnorm.json").read_text())
    assert np.isfinite(logs["evaluate"]["loss"])
    # Each replica normalises with its own half-batch's statistics (as tf.keras under Mirrored):
    # close to one device, not equal.
    assert logs["evaluate"]["loss"] == pytest.approx(ref["evaluate"]["loss"], rel=0.05)


def test_saved_model_loads_in_plain_keras_and_predicts_the_same(out):
    code = (
        "import sys, keras, numpy as np\n"
        f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
        "from sharded_keras import X_TEST\n"
        f"model = keras.models.load_model({str(out / 'sharded_sgd.keras')!r})\n"
        f"expected = np.load({str(out / 'sharded_sgd.npz')!r})['predictions']\n"
        "print(type(model).__name__, float(np.abs(model.predict(X_TEST, verbose=0) - expected).max()))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **ENV}
    )
    assert res.returncode == 0, res.stderr[-4000:]
    name, diff = res.stdout.split()[-2:]
    assert name == "Sequential" and float(diff) < 1e-6, res.stdout


def test_a_callback_reading_weights_on_the_chief_alone_is_refused(out):
    for rank in (0, 1):
        text = (out / f"sharded_refused_{rank}.txt").read_text()
        assert "ModelCheckpoint" in text and "FullyShardedStrategy" in text
    assert not (out / "never.keras").exists()


@pytest.mark.parametrize("mode", ["sharded", "plain"])
def test_keras_checkpoint_moves_between_one_device_and_shards(out, mode):
    # sharded: a fresh sharded model restores a one-device checkpoint (weights now, Adam's slots
    # when the optimizer builds them, each cut to its shard); plain: plain Keras restores the
    # sharded one. One more epoch from there must equal one device's from its own checkpoint:
    # a slot restored wrong (or not at all) changes every Adam update.
    ref, got = np.load(out / "reference_adam_continued.npz"), np.load(out / f"{mode}_adam_continued.npz")
    assert ref.files == got.files
    for key in ref.files:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_sharded_keras_checkpoint_is_written_shard_by_shard(out):
    files = sorted(p.name for p in (out / "sharded_adam_ckpt" / "sharded").iterdir())
    assert "__0_0.distcp" in files and "__1_0.distcp" in files, files


def test_custom_training_loop_with_a_keras_model_equals_one_device(out):
    # A Keras model and Keras optimizer in TF's custom-loop shape (strategy.run, compute_average_loss,
    # optimizer.apply): the optimizer's slots must be cut to the shards there too.
    ref, got = np.load(out / "reference_custom.npz"), np.load(out / "sharded_custom.npz")
    for key in ref.files:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
