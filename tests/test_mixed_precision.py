"""Mixed precision under the strategies: loss-scale decisions agree, Keras policies train as on one device.

bfloat16 autocast in custom loops is checked in test_compiled.py next to the compiled runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_job

SCRIPTS = Path(__file__).parent / "scripts"
ENV = {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}


def test_grad_scaler_overflow_on_one_replica_skips_the_step_everywhere(tmp_path):
    """float16 autocast + torch.amp.GradScaler under Mirrored: replica 1's gradients overflow at
    step 2. The all-reduce carries the inf to every replica, so every replica's scaler skips the
    same step and halves its scale: the scales and the parameters stay identical."""
    res = run_job(
        [sys.executable, str(SCRIPTS / "grad_scaler.py"), str(tmp_path), "mirrored"], timeout=120, cwd=tmp_path
    )
    assert res.returncode == 0, res.logs()
    runs = [json.loads((tmp_path / f"scaler_{r}.json").read_text()) for r in range(2)]
    for run in runs:
        assert [s["moved"] for s in run["steps"]] == [True, True, False, True, True], run["steps"]
        assert [s["scale"] for s in run["steps"]] == [1024.0, 1024.0, 512.0, 512.0, 512.0], run["steps"]
    assert runs[0] == runs[1], "replicas disagree on the loss scale or the parameters"


@pytest.fixture(scope="module")
def keras_reference(tmp_path_factory):
    refs = {}
    for variant in ("jit", "mixed_bfloat16", "mixed_float16"):
        out = tmp_path_factory.mktemp(f"keras-ref-{variant}")
        res = run_job(
            [sys.executable, str(SCRIPTS / "keras_precision.py"), str(out), "reference", variant],
            timeout=150,
            cwd=out,
            env=ENV,
        )
        assert res.returncode == 0, res.logs()[-6000:]
        refs[variant] = out
    return refs


def _load(out: Path, rank: int) -> tuple[dict, dict]:
    return dict(np.load(out / f"weights_{rank}.npz")), json.loads((out / f"history_{rank}.json").read_text())


@pytest.mark.timeout(600)  # jit_compile: inductor generates C++ code, minutes on 2 loaded cores
@pytest.mark.parametrize(
    "variant,tol",
    [
        ("jit", 1e-5),  # jit_compile=True (torch.compile, inductor) against eager Keras
        ("mixed_float16", 1e-3),  # float16 compute: per-replica partial gradients are rounded to float16
    ],
)
@pytest.mark.parametrize("mode", ["mirrored", "central_storage"])
def test_keras_fit_under_strategy_matches_one_device(tmp_path, keras_reference, variant, tol, mode):
    if variant == "jit" and mode == "central_storage":
        pytest.skip("one jit_compile run (inductor, about a minute of C++ compilation per process) is enough")
    res = run_job(
        [sys.executable, str(SCRIPTS / "keras_precision.py"), str(tmp_path), mode, variant],
        timeout=420,
        cwd=tmp_path,
        env=ENV,
    )
    assert res.returncode == 0, res.logs()[-6000:]
    (w0, h0), (w1, h1) = _load(tmp_path, 0), _load(tmp_path, 1)
    ref_w, ref_h = _load(keras_reference[variant], 0)
    diff = max(float(np.abs(w0[k] - ref_w[k]).max()) for k in ref_w)
    print(f"\n{mode} {variant}: max |weight - one device| {diff:.3g}")
    assert diff < tol
    assert max(abs(a - b) for a, b in zip(h0["history"]["loss"], ref_h["history"]["loss"])) < tol * 10
    assert h0["loss_scale"] == ref_h["loss_scale"], "the loss scale must follow the one-device run"
    assert all(np.array_equal(w0[k], w1[k]) for k in w0) and h0 == h1, "replicas diverged"
