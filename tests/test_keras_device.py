"""Keras tensors land on the replicas' device even where Keras' default device is another.

On the torch backend Keras makes its tensors on the GPU whenever one exists, also for CPU
replicas: on an H100 machine, a notebook testing MirroredStrategy(["cpu:0", "cpu:1"]) after using
its GPU failed its fit (GPU metric state beside CPU weights). Here the meta device stands in for
that GPU, so the check runs on every machine; tests/test_gpu.py runs the real one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_job

pytest.importorskip("keras")

SCRIPT = Path(__file__).parent / "scripts" / "keras_other_default_device.py"


@pytest.mark.parametrize("kind", ["one_device", "mirrored"])
def test_keras_follows_the_replica_device_not_its_own_default(tmp_path, kind):
    out = tmp_path / "result.json"
    res = run_job([sys.executable, str(SCRIPT), str(out), kind], timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.output
    result = json.loads(out.read_text())
    assert result["weights"] == ["cpu"], result  # model and optimizer variables
    assert result["made_in_run"] == "cpu", result  # what a replica function makes through Keras
    assert result["worst"] < 1e-5, result  # and the fit equals Keras on the CPU alone
    assert result["outside"] == "meta", result  # outside the strategy Keras keeps the user's choice
