"""R users through reticulate (issue #34): the first seed's workflow run from R with phalanx.

Real ``Rscript`` processes: ``examples/r/seed_000.R`` under ``Rscript script.R`` and under
``Rscript -e 'source("script.R")'`` (OneDevice, CentralStorage x2 and Mirrored x2 created up front
in one R process, as the seed does; dropout 0, so every strategy must end with the one-device
weights), and ``tests/scripts/r_replicas.R`` for the failures of the fork route (a script over
4 KiB read by two copies through one file position; a forked copy deleting replica 0's R
``tempdir()``; a replica failing after training while replica 0 exits 0). Each job runs once
(module fixtures); several tests assert its parts. Every job runs with its own ``TMPDIR``, so
that the R temporary directories it leaves behind can be counted, and in its own session, whose
processes must all have ended with it.

Skipped, with the reason, where ``Rscript`` or reticulate is missing or reticulate cannot load
this Python's NumPy (Debian's reticulate 1.28 predates NumPy 2; ``.ci/run`` runs these tests in
its oldest-versions job).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import psutil
import pytest

from phalanx.config import stack_signal

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "r" / "seed_000.R"
REPLICAS = ROOT / "tests" / "scripts" / "r_replicas.R"
STRATEGIES = ("one_device", "central_storage", "mirrored", "multiworker_mirrored")
TIMEOUT_S = 240.0


@cache
def _r_missing() -> str | None:
    """Why R cannot run these tests here, or None."""
    if shutil.which("Rscript") is None:
        return "Rscript not found (Debian: apt-get install r-base-core r-cran-reticulate)"
    probe = 'library(reticulate); np <- import("numpy"); invisible(np$zeros(1L)); invisible(r_to_py(matrix(1)))'
    try:
        done = subprocess.run(
            ["Rscript", "-e", probe],
            env={**os.environ, "RETICULATE_PYTHON": sys.executable},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return "reticulate's probe did not finish in 60 s"
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip() and line != "Execution halted"]
        return f"reticulate is missing or cannot use this Python's NumPy: {(lines or ['?'])[-1].strip()}"
    return None


@pytest.fixture(scope="module", autouse=True)
def _needs_r():
    reason = _r_missing()
    if reason:
        pytest.skip(reason)


@dataclass
class RRun:
    returncode: int
    output: str  # replica 0's stdout and stderr
    logs: str  # the other replicas' logs
    left: list[str]  # processes of the job's session still alive after replica 0 ended
    tmp_left: list[str]  # R temporary directories left in the job's TMPDIR
    elapsed: float


def run_r(args: list[str], folder: Path, *, timeout: float = TIMEOUT_S) -> RRun:
    """Runs ``Rscript args`` in its own session and TMPDIR; hard timeout, then stacks and SIGKILL."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp, logs = folder / "tmp", folder / "logs"
    tmp.mkdir()
    env = {
        **os.environ,
        "RETICULATE_PYTHON": sys.executable,
        "KERAS_BACKEND": "torch",
        "TMPDIR": str(tmp),
        "PHALANX_LOG_ROOT": str(logs),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    started = time.monotonic()
    with open(folder / "out.txt", "wb") as out:
        proc = subprocess.Popen(
            ["Rscript", *args],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in _session(proc.pid):
                p.send_signal(stack_signal())  # a Python stack from each replica (faulthandler)
            time.sleep(1.0)
        finally:
            elapsed = time.monotonic() - started
            # The job's processes a moment after replica 0 ended: a replica ends with it (its
            # launcher is gone) within the parent watch's period.
            deadline = time.monotonic() + 3.0
            while _session(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = [" ".join(p.cmdline()) for p in _session(proc.pid)]
            for p in _session(proc.pid):
                p.kill()
            proc.wait()
    output = (folder / "out.txt").read_text(errors="replace")
    replica_logs = "\n".join(p.read_text(errors="replace") for p in sorted(logs.rglob("*.log")))
    if proc.returncode == -signal.SIGKILL or elapsed >= timeout:
        pytest.fail(f"Rscript {args} timed out after {timeout} s\n{output[-8000:]}\n{replica_logs[-8000:]}")
    tmp_left = sorted(p.name for p in tmp.iterdir() if p.name.startswith("Rtmp"))
    return RRun(proc.returncode, output, replica_logs, left, tmp_left, elapsed)


def _session(pid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != pid and os.getsid(p.pid) == pid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


# ----------------------------------------------------------------------------- the seed's example
SEED_ARGS = ["--epochs=2", "--dropout=0", "--samples=1024"]


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory) -> dict[str, RRun]:
    runs = {}
    return runs


def _seed_run(seed_runs: dict[str, RRun], how: str, tmp_path_factory) -> RRun:
    if how not in seed_runs:
        folder = tmp_path_factory.mktemp(f"seed_{how}")
        if how == "script":
            args = [str(EXAMPLE), *SEED_ARGS]
        else:
            args = ["-e", f'source("{EXAMPLE}")', *SEED_ARGS]
        seed_runs[how] = run_r(args, folder)
    return seed_runs[how]


def _difference(text: str, replica: int, strategy: str) -> float:
    found = re.search(rf"replica {replica}: {strategy} +replicas (\d) .*max \|w - w_one_device\| (\S+)", text)
    assert found, f"no result line for replica {replica}, {strategy}:\n{text[-6000:]}"
    assert int(found.group(1)) == (1 if strategy == "one_device" else 2)
    return float(found.group(2))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("how", ["script", "source"])
def test_seed_example_matches_one_device(seed_runs, tmp_path_factory, how, strategy):
    """``Rscript seed_000.R`` / ``source()``: every strategy ends with the one-device weights, on both replicas."""
    run = _seed_run(seed_runs, how, tmp_path_factory)
    assert run.returncode == 0, run.output[-6000:] + run.logs[-6000:]
    assert _difference(run.output, 0, strategy) < 1e-5
    assert _difference(run.logs, 1, strategy) < 1e-5


@pytest.mark.parametrize("how", ["script", "source"])
def test_seed_example_leaves_nothing_behind(seed_runs, tmp_path_factory, how):
    run = _seed_run(seed_runs, how, tmp_path_factory)
    assert run.returncode == 0, run.output[-6000:]
    assert run.left == [], f"processes left after replica 0 ended: {run.left}"
    assert run.tmp_left == [], f"R temporary directories left: {run.tmp_left}"
    assert not [p for p in os.listdir("/dev/shm") if "phalanx" in p.lower()]


# ----------------------------------------------------------------------------- the fork's failures
@pytest.fixture(scope="module")
def replicas_ok(tmp_path_factory) -> RRun:
    return run_r([str(REPLICAS)], tmp_path_factory.mktemp("r_ok"))


def test_script_over_4k_runs_to_its_end_on_every_replica(replicas_ok):
    """A forked R shared one position in the script: one copy missed the code past the first 4 KiB."""
    assert REPLICAS.stat().st_size > 4096
    both = replicas_ok.output + replicas_ok.logs
    assert replicas_ok.returncode == 0, both[-6000:]
    for replica in (0, 1):
        assert f"replica {replica} trained" in both, both[-6000:]
        assert f"replica {replica} end tempdir-exists TRUE" in both, both[-6000:]
    assert replicas_ok.left == [] and replicas_ok.tmp_left == []


def test_replicas_have_their_own_r_tempdir(replicas_ok):
    """A forked R named replica 0's tempdir() and deleted it when it exited first."""
    both = replicas_ok.output + replicas_ok.logs
    dirs = dict(re.findall(r"replica (\d) pid \d+ tempdir (\S+)", both))
    assert set(dirs) == {"0", "1"}, both[-6000:]
    assert dirs["0"] != dirs["1"]
    # replica 0 says so after close(), which waited for replica 1 to end
    assert "replica 0 end tempdir-exists TRUE" in replicas_ok.output


@pytest.fixture(scope="module")
def replica_fails(tmp_path_factory) -> RRun:
    return run_r([str(REPLICAS), "fail"], tmp_path_factory.mktemp("r_fail"))


def test_replica_failing_after_training_fails_the_program(replica_fails):
    """The fork route exited 0 with no message; now close() raises ReplicaFailedError naming it."""
    out = replica_fails.output
    assert replica_fails.returncode != 0, out[-6000:]
    assert "replica 0 trained" in out
    assert "ReplicaFailedError" in out and "replica 1" in out, out[-6000:]
    assert "RuntimeError: replica 1 fails after training" in out, out[-6000:]
    assert "replica 0 end tempdir-exists" not in out  # the program stopped at close()
    assert replica_fails.left == [] and replica_fails.tmp_left == []
    assert replica_fails.elapsed < 120


def test_r_console_gets_a_typed_error(tmp_path):
    """R reading its program from stdin cannot be run again as a replica: a LaunchError, at once."""
    program = tmp_path / "stdin.R"
    program.write_text(
        'library(reticulate)\nphalanx <- import("phalanx")\nphalanx$MirroredStrategy(list("cpu:0", "cpu:1"))\n'
    )
    env = {**os.environ, "RETICULATE_PYTHON": sys.executable, "KERAS_BACKEND": "torch"}
    env.pop("PYTEST_CURRENT_TEST", None)
    with open(program) as stdin:
        done = subprocess.run(["Rscript", "-"], stdin=stdin, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "LaunchError" in done.stderr and "Rscript script.R" in done.stderr, done.stderr[-4000:]
