"""Restoring a Keras optimizer from a Checkpoint, as TF does (issue 28).

TF restores at once every variable that exists when ``restore()`` runs (a Keras optimizer's
``iterations`` and learning rate), and the rest (the slots its first step creates) when they
are created ("deferred restoration"), each variable once. phalanx deferred the whole optimizer:
``iterations`` read 0 where 36 were saved until the first step, and that first step's build
overwrote whatever the program had set in between. One job (tests/scripts/ckpt_keras_optimizer.py)
runs every case without a strategy and under MirroredStrategy x2; each test asserts on a part.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_job

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_keras_optimizer.py"
K, LR, NEW_LR = 3, 0.05, 0.01  # the script's


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_keras")
    res = run_job(
        [sys.executable, str(SCRIPT), str(out)],
        timeout=240,
        cwd=out,
        env={"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.logs()[-6000:]
    ranks = [json.loads((out / f"ckpt_keras_{r}.json").read_text()) for r in range(2)]
    # One record per run: no strategy (replica 0's process), then each Mirrored replica.
    return {"none": ranks[0]["none"], "mirrored_0": ranks[0]["mirrored"], "mirrored_1": ranks[1]["mirrored"]}


RUNS = ["none", "mirrored_0", "mirrored_1"]


def _same(a, b):
    return all(np.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("run", RUNS)
def test_iterations_and_learning_rate_are_restored_at_once(results, run):
    rec = results[run]
    assert rec["saved"]["iterations"] == K
    for case in ("unbuilt", "built"):
        at_once = rec[case]["at_once"]
        assert at_once["iterations"] == K, f"{case}: optimizer.iterations right after restore()"
        assert at_once["learning_rate"] == pytest.approx(LR), f"{case}: the saved learning rate"
    # The slots do not exist yet: their restoration waits for them.
    assert rec["unbuilt"]["pending"] == ["optimizer"]
    assert rec["built"]["pending"] == []


@pytest.mark.parametrize("run", RUNS)
def test_slots_are_the_saved_ones_when_created(results, run):
    rec = results[run]
    assert len(rec["saved"]["slots"]) == 8  # Adam: a first and a second moment per variable
    assert _same(rec["unbuilt"]["created"]["slots"], rec["saved"]["slots"])
    assert _same(rec["built"]["at_once"]["slots"], rec["saved"]["slots"])


@pytest.mark.parametrize("run", RUNS)
def test_resuming_loop_continues_the_saved_run(results, run):
    # The loop resumes at step int(optimizer.iterations): step K+1 after the restore must be step
    # K+1 of the uninterrupted run (the restored slots, the restored count).
    rec = results[run]
    goal = rec["uninterrupted"]
    assert goal["iterations"] == K + 1
    for got in (rec["continued"], rec["built"]["continued"]):
        assert got["iterations"] == K + 1
        assert _same(got["weights"], goal["weights"]), "the resumed run differs from the uninterrupted one"
        assert _same(got["slots"], goal["slots"])


@pytest.mark.parametrize("run", RUNS)
def test_a_value_set_between_restore_and_the_first_step_is_kept(results, run):
    # Restored once, at restore(): creating the slots restores the slots only (TF's rule).
    rec = results[run]
    assert rec["lr_set"]["learning_rate"] == pytest.approx(NEW_LR)
    assert rec["lr_set"]["iterations"] == K + 1


def test_mirrored_replicas_restore_the_same_state(results):
    a, b = results["mirrored_0"], results["mirrored_1"]
    for case in ("unbuilt", "built"):
        assert a[case]["at_once"] == b[case]["at_once"]
    for case in ("continued", "lr_set"):
        assert a[case] == b[case]
    assert a["built"]["continued"] == b["built"]["continued"]
    # ...and the same as without a strategy: Mirrored x2 sums the two halves of each global batch.
    assert _same(a["continued"]["weights"], results["none"]["continued"]["weights"])
