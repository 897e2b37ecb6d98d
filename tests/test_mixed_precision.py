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


CASES = [
    ("jit", 1e-5),  # jit_compile=True (torch.compile, inductor) against eager Keras
    ("mixed_float16", 1e-3),  # float16 compute: per-replica partial gradients are rounded to float16
]
MODES = ["mirrored", "central_storage"]


def _runs() -> list[str]:
    # one jit_compile run (inductor, about a minute of C++ compilation per process) is enough
    return [
        f"{mode},{variant}" for mode in MODES for variant, _ in CASES if not (variant == "jit" and mode != MODES[0])
    ]


GRAD_SCALER_RUN = "grad_scaler,mirrored"
REFERENCE_RUNS = [f"reference,{v}" for v in ("jit", "mixed_bfloat16", "mixed_float16")]


@pytest.fixture(scope="module")
def strategy_runs(tmp_path_factory):
    """Every strategy run in ONE job: both strategies, one after the other on the same two processes,
    then the torch GradScaler run on them; then replica 0 runs the plain-Keras one-device references
    (every variant) in the same process."""
    out = tmp_path_factory.mktemp("keras-strategies")
    res = run_job(
        [sys.executable, str(SCRIPTS / "keras_precision.py"), str(out), *_runs(), GRAD_SCALER_RUN, *REFERENCE_RUNS],
        timeout=560,
        cwd=out,
        env=ENV,
    )
    assert res.returncode == 0, res.logs()[-6000:]
    return out


@pytest.fixture(scope="module")
def keras_reference(strategy_runs):
    """Plain Keras on one device, every variant: {variant: folder}."""
    return {run.split(",")[1]: strategy_runs / run for run in REFERENCE_RUNS}


def _load(out: Path, rank: int) -> tuple[dict, dict]:
    return dict(np.load(out / f"weights_{rank}.npz")), json.loads((out / f"history_{rank}.json").read_text())


@pytest.mark.timeout(600)  # jit_compile: inductor generates C++ code, minutes on 2 loaded cores
@pytest.mark.parametrize("variant,tol", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_keras_fit_under_strategy_matches_one_device(strategy_runs, keras_reference, variant, tol, mode):
    if f"{mode},{variant}" not in _runs():
        pytest.skip("one jit_compile run (inductor, about a minute of C++ compilation per process) is enough")
    folder = strategy_runs / f"{mode},{variant}"
    (w0, h0), (w1, h1) = _load(folder, 0), _load(folder, 1)
    ref_w, ref_h = _load(keras_reference[variant], 0)
    diff = max(float(np.abs(w0[k] - ref_w[k]).max()) for k in ref_w)
    print(f"\n{mode} {variant}: max |weight - one device| {diff:.3g}")
    assert diff < tol
    assert max(abs(a - b) for a, b in zip(h0["history"]["loss"], ref_h["history"]["loss"])) < tol * 10
    assert h0["loss_scale"] == ref_h["loss_scale"], "the loss scale must follow the one-device run"
    assert all(np.array_equal(w0[k], w1[k]) for k in w0) and h0 == h1, "replicas diverged"


@pytest.mark.timeout(600)  # it shares the Keras job (jit_compile: minutes on 2 loaded cores)
def test_grad_scaler_overflow_on_one_replica_skips_the_step_everywhere(strategy_runs):
    """float16 autocast + torch.amp.GradScaler under Mirrored: replica 1's gradients overflow at
    step 2. The all-reduce carries the inf to every replica, so every replica's scaler skips the
    same step and halves its scale: the scales and the parameters stay identical."""
    folder = strategy_runs / GRAD_SCALER_RUN
    runs = [json.loads((folder / f"scaler_{r}.json").read_text()) for r in range(2)]
    for run in runs:
        assert [s["moved"] for s in run["steps"]] == [True, True, False, True, True], run["steps"]
        assert [s["scale"] for s in run["steps"]] == [1024.0, 1024.0, 512.0, 512.0, 512.0], run["steps"]
    assert runs[0] == runs[1], "replicas disagree on the loss scale or the parameters"
