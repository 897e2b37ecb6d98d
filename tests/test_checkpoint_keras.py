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


SELF_LAUNCHED = ["one_device", "mirrored"]  # one job: one_device on the first process, then both


@pytest.fixture(scope="module")
def self_launched_job(tmp_path_factory) -> tuple[Path, int, str]:
    out = tmp_path_factory.mktemp("backup-self-launched")
    res = run_job(
        [sys.executable, str(SCRIPT), str(out), ",".join(SELF_LAUNCHED)],
        timeout=150 * len(SELF_LAUNCHED),
        cwd=out,
        env=ENV,
    )
    return out, res.returncode, res.logs()[-6000:]


@pytest.mark.skipif(not KERAS_INTEGRATION, reason="needs Keras and phalanx.keras")
@pytest.mark.parametrize("kind", ["one_device", "mirrored", "mwms"])
def test_backup_and_restore_resumes_with_exact_batch_count(request, tmp_path, kind):
    if kind in SELF_LAUNCHED:
        out, code, logs = request.getfixturevalue("self_launched_job")
        # one_device's result is whole before mirrored starts: a later failure is mirrored's.
        assert code == 0 or kind != SELF_LAUNCHED[-1], logs
        assert (out / kind / "result_0.json").exists(), (kind, code, logs)
    else:
        launcher = [sys.executable, "-m", "phalanx.cli", "run", "-n", "2"]
        res = run_job(launcher + [str(SCRIPT), str(tmp_path), kind], timeout=150, cwd=tmp_path, env=ENV)
        assert res.returncode == 0, res.logs()[-6000:]
        out = tmp_path
    replicas = 1 if kind == "one_device" else 2
    for rank in range(replicas):
        result = json.loads((out / kind / f"result_{rank}.json").read_text())
        assert result == {
            "iterations": 15,
            "canary": 15.0,
            "executed": 5 + 3 + 10,
            "second_fit_epochs": [1, 2],
            "backup_deleted": True,
        }, (rank, result)
