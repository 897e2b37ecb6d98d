"""keras.callbacks.BackupAndRestore under phalanx strategies (Keras' own test, issue 7 item 4).

OneDevice, Mirrored on 2 CPU replicas, MultiWorkerMirrored with 2 workers (phalanx run -n 2).

An exception at batch 2 of epoch 1, then ``fit`` again: training resumes from the backup and the
batches trained, as the restored training state counts them (optimizer iterations, a canary
weight), equal the uninterrupted 3 x 5; Keras redoes the 3 batches of the unfinished epoch.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import run_job

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_keras_backup.py"
ENV = {"KERAS_BACKEND": "torch", "PHALANX_COLLECTIVE_TIMEOUT": "20"}
KERAS_INTEGRATION = (
    importlib.util.find_spec("keras") is not None
    and (Path(__file__).resolve().parents[1] / "src" / "phalanx" / "keras" / "__init__.py").exists()
)


@pytest.mark.skipif(not KERAS_INTEGRATION, reason="needs Keras and phalanx.keras")
@pytest.mark.parametrize("kind", ["one_device", "mirrored", "mwms"])
def test_backup_and_restore_resumes_with_exact_batch_count(tmp_path, kind):
    launcher = [sys.executable, "-m", "phalanx.cli", "run", "-n", "2"] if kind == "mwms" else [sys.executable]
    res = run_job(launcher + [str(SCRIPT), str(tmp_path), kind], timeout=150, cwd=tmp_path, env=ENV)
    assert res.returncode == 0, res.logs()[-6000:]
    replicas = 1 if kind == "one_device" else 2
    for rank in range(replicas):
        result = json.loads((tmp_path / f"result_{rank}.json").read_text())
        assert result == {
            "iterations": 15,
            "canary": 15.0,
            "executed": 5 + 3 + 10,
            "second_fit_epochs": [1, 2],
            "backup_deleted": True,
        }, (rank, result)
