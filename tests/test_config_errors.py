"""A configuration error (a TF_CONFIG typo, a malformed PHALANX_* variable) reads as its one line.

Before, a TF_CONFIG typo showed 8 frames of phalanx's internals (the strategy, the resolver, the
validation) before the one line that says what is wrong; under ``phalanx run -n 2`` both replicas
started and imported torch before either found it. Now the program's own frames and the error's
line are shown (``PHALANX_DEBUG=1`` or ``phalanx run --debug`` shows phalanx's frames too), and
``phalanx run`` checks TF_CONFIG and its settings before it starts anything.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import run_job

TYPO = json.dumps(
    {"cluster": {"wroker": ["localhost:23456", "localhost:23457"]}, "task": {"type": "worker", "index": 0}}
)
TRAIN = """
import pathlib, torch, phalanx as px
pathlib.Path("started").touch()
strategy = px.MultiWorkerMirroredStrategy()
print("trained", flush=True)
"""
LINE = "phalanx.errors.ClusterSpecError: Invalid cluster configuration: cluster.wroker="
PHALANX_FRAME = re.compile(r'File "[^"]*/phalanx/[^"]*", line \d+')


@pytest.mark.parametrize("debug", [False, True])
def test_a_tf_config_typo_shows_its_line_and_the_programs_frames_only(tmp_path, script, debug):
    env = {"TF_CONFIG": TYPO, **({"PHALANX_DEBUG": "1"} if debug else {})}
    result = run_job([sys.executable, str(script(TRAIN, "train.py"))], timeout=120, cwd=tmp_path, env=env)
    out = result.output
    assert result.returncode == 1 and "trained" not in out, out
    assert out.count(LINE) == 1 and "HINT: allowed job names" in out, out
    # Where the program made the strategy: its own frame, with its line.
    assert re.search(r'train\.py", line \d+, in <module>\n +strategy = px\.MultiWorkerMirroredStrategy\(\)', out), out
    if debug:
        assert len(PHALANX_FRAME.findall(out)) >= 3, out
    else:
        assert not PHALANX_FRAME.findall(out), out
        assert "PHALANX_DEBUG=1" in out, out  # how to see them


def test_phalanx_run_checks_tf_config_before_it_starts_a_replica(tmp_path, script):
    path = script(TRAIN, "train.py")
    result = run_job(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(path)],
        timeout=60,
        cwd=tmp_path,
        env={"TF_CONFIG": TYPO},
    )
    out = result.output
    assert result.returncode == 2, out
    assert not (tmp_path / "started").exists(), "a replica started"
    assert "replica(s) on this host" not in out, out
    assert out.count("Invalid cluster configuration: cluster.wroker=") == 1 and "Traceback" not in out, out
    assert out.startswith("phalanx run: TF_CONFIG: "), out


def test_phalanx_run_checks_its_settings_before_it_starts_a_replica(tmp_path, script):
    result = run_job(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(script(TRAIN, "train.py"))],
        timeout=60,
        cwd=tmp_path,
        env={"PHALANX_RENDEZVOUS_TIMEOUT": "2 minutes"},
    )
    assert result.returncode == 2 and not (tmp_path / "started").exists(), result.output
    assert "PHALANX_RENDEZVOUS_TIMEOUT='2 minutes': must be a number of seconds" in result.output, result.output
    assert "Traceback" not in result.output, result.output
