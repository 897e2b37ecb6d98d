"""TF's resume workflow under a strategy: ``keras.models.load_model`` of a compiled ``.keras`` file
inside ``strategy.scope()``, then ``fit`` goes on with the saved optimizer state.

One job per strategy (tests/scripts/keras_load_model.py) trains on one device, saves, and trains on
(the uninterrupted run); two replicas then load the file in scope and train the same epochs.
Weights, Adam's slots, its iteration count and the losses must equal the uninterrupted run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import has_fsdp2, run_job

pytestmark = pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="Keras is not installed")
SCRIPT = Path(__file__).parent / "scripts" / "keras_load_model.py"


def _sharding_supported() -> bool:
    version = tuple(int(p) for p in importlib.metadata.version("keras").split(".")[:2])
    return has_fsdp2() and version >= (3, 7)


@pytest.mark.parametrize(
    "kind",
    [
        "mirrored",
        pytest.param(
            "sharded",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("keras") is None or not _sharding_supported(),
                reason="sharding a Keras model needs FSDP2 (torch >= 2.6) and Keras >= 3.7",
            ),
        ),
    ],
)
def test_a_model_loaded_in_scope_resumes_as_the_uninterrupted_run(tmp_path, kind):
    res = run_job(
        [sys.executable, str(SCRIPT), str(tmp_path), kind],
        timeout=240,
        cwd=tmp_path,
        env={"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.logs()[-6000:]
    replicas = [json.loads((tmp_path / f"load_model_{r}.json").read_text()) for r in (0, 1)]
    reference = replicas[0]["reference"]
    for rank, got in enumerate(replicas):
        assert got["restored_iterations"] == reference["saved_iterations"] == 6, (rank, got["restored_iterations"])
        assert got["iterations"] == reference["iterations"] == 12
        assert np.allclose(got["loss"], reference["loss"], rtol=1e-5, atol=1e-6), (rank, got["loss"], reference["loss"])
        for name in ("weights", "optimizer"):
            assert len(got[name]) == len(reference[name]), name
            worst = max(float(np.abs(np.array(a) - np.array(b)).max()) for a, b in zip(got[name], reference[name]))
            assert worst < 1e-5, (rank, name, worst)
    assert replicas[0]["weights"] == replicas[1]["weights"], "replicas diverged"
