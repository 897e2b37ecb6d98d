"""A Keras custom training loop under CentralStorageStrategy (issue 28, class 7).

TF's custom-training tutorial (``optimizer.apply_gradients`` inside ``strategy.run``, the loss from
``compute_average_loss``) crashed under CentralStorage: only the chief receives the summed
gradients there, and Keras' ``apply`` raised on the other replica. One job
(tests/scripts/keras_custom_loop_central.py) trains the same model, data and global batch under
CentralStorage x2, Mirrored x2 and on one device; each test asserts on a part.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import run_job  # noqa: E402

keras = pytest.importorskip("keras")

from phalanx.keras.optimizer_adapter import optimizers_used_by  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "keras_custom_loop_central.py"
K = 4  # the script's steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ctl_central")
    res = run_job(
        [sys.executable, str(SCRIPT), str(out)],
        timeout=240,
        cwd=out,
        env={"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.logs()[-6000:]

    def load(kind, rank):
        with np.load(out / f"{kind}_{rank}.npz") as z:
            weights = [z[f"arr_{i}"] for i in range(len(z.files))]
        return weights, json.loads((out / f"{kind}_{rank}.json").read_text())

    return {(kind, r): load(kind, r) for kind in ("central", "mirrored") for r in range(2)} | {
        ("none", 0): load("none", 0)
    }


def _close(a, b):
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))


def test_central_storage_custom_loop_equals_one_device(runs):
    reference, ref_record = runs[("none", 0)]
    for rank in range(2):
        weights, record = runs[("central", rank)]
        assert _close(weights, reference), f"replica {rank}: K steps under CentralStorage x2 differ from one device"
        np.testing.assert_allclose(record["losses"], ref_record["losses"], rtol=1e-5)


def test_central_storage_custom_loop_equals_mirrored(runs):
    for rank in range(2):
        assert _close(runs[("central", rank)][0], runs[("mirrored", rank)][0])
        np.testing.assert_allclose(
            runs[("central", rank)][1]["losses"], runs[("mirrored", rank)][1]["losses"], rtol=1e-6
        )


def test_every_replica_counts_every_step_and_reports_the_global_metric(runs):
    ref_record = runs[("none", 0)][1]
    assert ref_record["iterations"] == K
    for kind in ("central", "mirrored"):
        for rank in range(2):
            record = runs[(kind, rank)][1]
            assert record["iterations"] == K, (kind, rank, record)
            assert record["accuracy"] == pytest.approx(ref_record["accuracy"]), (kind, rank, record)


class _Trainer:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def train_step(self):
        return self.optimizer.iterations


def test_optimizers_are_found_where_custom_loops_keep_them():
    """How the function given to ``run`` reaches its optimizer: a global, a closure, ``self``, a model."""
    in_closure, on_self, compiled = (keras.optimizers.SGD() for _ in range(3))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=compiled, loss="mse")
    big = list(range(1000))  # data: never searched

    def helper():
        return in_closure.iterations, model

    def step():
        return helper(), big

    assert {id(o) for o in optimizers_used_by(step)} == {id(in_closure), id(compiled)}
    assert optimizers_used_by(_Trainer(on_self).train_step) == [on_self]
    assert optimizers_used_by(lambda: None) == []
