"""Launchers started with a closed stdout, stderr or stdin, or writing into a pipe that closes early (issue 29).

Daemons, cron and some CI runners start programs with a standard descriptor closed (``cmd >&-``);
``cmd | head -1`` closes the pipe after one line. ``python train.py`` copes: ``sys.stdout`` is
None and ``print`` does nothing; a write into the closed pipe raises ``BrokenPipeError``, which
ends the program with exit 1 unless it handles it (as the Python documentation shows). Each launcher
(``phalanx run``, self-launch, ``phalanx run --ps``) must do the same: a job that succeeds exits 0,
one that fails exits non-zero with its error, and phalanx's own output (its messages, ``--tee``)
never turns a success into a failure or prints a traceback of its own.

Every job is a real process tree started through ``bash`` with the descriptor closed (a
``subprocess.DEVNULL`` descriptor would be open), fresh (not from the suite's fork servers, whose
descriptors are the test's), each under a hard timeout. The ``plain`` rows run ``python job.py``
without a strategy: the oracle the launchers are held to.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = r"""
import os, sys, time

launcher, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
rank = 0
if launcher != "plain":
    import torch

    import phalanx as px

    if launcher == "ps":
        strategy = px.ParameterServerStrategy()  # ps and worker tasks serve, then exit here
        from phalanx.coordinator import ClusterCoordinator

        coordinator = ClusterCoordinator(strategy)
        coordinator.schedule(lambda: 1)
        coordinator.join()
    else:
        # Self-launch over 3 devices starts a fork server of its own, which a closed descriptor broke.
        strategy = px.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) if launcher == "self" else px.MirroredStrategy()
        rank = strategy.extended.process_index
        total = strategy.reduce("sum", strategy.run(lambda: torch.ones(1)), axis=None)
        assert total.item() == strategy.num_replicas_in_sync


def note(i):
    if sys.stderr is not None:  # None under a closed stderr, as in any Python program
        print("note", i, file=sys.stderr, flush=True)


if rank == 0:
    if mode in ("ok", "fail"):
        for i in range(20):
            print("line", i, flush=True)
            note(i)
        if mode == "fail":
            raise ValueError("planned failure")
    elif mode == "many":  # more than a pipe holds: only the reader's pace ends it
        for i in range(3000):
            print("line", i, "x" * 60, flush=True)
            if i % 100 == 0:
                time.sleep(0.05)
    else:  # "pipe" / "pipe-unhandled": write until the reader has gone
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                print("line", flush=True)
                time.sleep(0.01)
        except BrokenPipeError:
            if mode == "pipe-unhandled":
                raise
            # What the Python documentation recommends (signal module, "Note on SIGPIPE").
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
with open(os.path.join(out, f"done_{rank}"), "w") as f:
    f.write("done")
"""

LAUNCHERS = {
    "plain": ([], ["done_0"]),
    "run": (["-m", "phalanx.cli", "run", "-n", "2"], ["done_0", "done_1"]),
    "self": ([], ["done_0", "done_1", "done_2"]),
    "ps": (["-m", "phalanx.cli", "run", "--ps", "1", "--workers", "1"], ["done_0"]),
}
# How bash starts the command ("$@"): the descriptor closed, or stdout into `head -n 1`.
SHELL = {
    "stdout": 'exec "$@" >&-',
    "stderr": 'exec "$@" 2>&-',
    "stdin": 'exec "$@" <&-',
    "pipe": '"$@" | head -n 1; exit "${PIPESTATUS[0]}"',
}
TIMEOUT = {"plain": 60, "run": 150, "self": 150, "ps": 200}


def _launch(tmp_path: Path, launcher: str, descriptor: str, mode: str, extra: tuple[str, ...] = ()):
    """Runs the job through bash with ``descriptor`` closed; (exit status, stdout, stderr, done files)."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = tmp_path / "out"
    out.mkdir()
    prefix, _ = LAUNCHERS[launcher]
    command = [sys.executable, *prefix, *extra, str(job), launcher, str(out), mode]
    env = {**os.environ, "PHALANX_LOG_ROOT": str(tmp_path / "logs"), "PHALANX_COLLECTIVE_TIMEOUT": "30"}
    env.pop("PYTEST_CURRENT_TEST", None)  # self-launch refuses to start replicas under pytest
    env.pop("PHALANX_FORK_SERVER", None)
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(stdout, "wb") as o, open(stderr, "wb") as e:
        proc = subprocess.Popen(
            ["bash", "-c", SHELL[descriptor], "bash", *command],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=TIMEOUT[launcher])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(
                f"{launcher} with {descriptor} {mode} did not end in {TIMEOUT[launcher]} s:\n" + _logs(tmp_path)
            )
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    done = sorted(p.name for p in out.iterdir())
    return code, stdout.read_text(errors="replace"), stderr.read_text(errors="replace"), done


def _logs(tmp_path: Path) -> str:
    parts = [f"--- {name} ---\n" + (tmp_path / name).read_text(errors="replace") for name in ("stderr.txt",)]
    parts += [f"--- {p} ---\n" + p.read_text(errors="replace")[-3000:] for p in sorted(tmp_path.rglob("*.log"))]
    return "\n".join(parts)[-12000:]


def _frames(stderr: str) -> list[str]:
    return re.findall(r'^\s*File "([^"]+)"', stderr, re.MULTILINE)


@pytest.mark.parametrize("descriptor", ["stdout", "stderr", "stdin", "pipe"])
@pytest.mark.parametrize("launcher", ["plain", "run", "self", "ps"])
def test_a_successful_job_exits_0_without_a_traceback(tmp_path, launcher, descriptor):
    """Succeeds as ``python job.py`` does: every replica finishes, status 0, no traceback (today's
    ``phalanx run >&-`` crashed after training; ``2>&-`` killed replica 0 at start)."""
    mode = "pipe" if descriptor == "pipe" else "ok"
    code, stdout, stderr, done = _launch(tmp_path, launcher, descriptor, mode)
    assert (code, done) == (0, LAUNCHERS[launcher][1]), _logs(tmp_path)
    assert "Traceback" not in stderr and "Error" not in stderr, _logs(tmp_path)
    if descriptor == "pipe":
        assert stdout.startswith("line"), stdout[:200]  # the reader got the first line
    if descriptor in ("stdin", "pipe") and launcher != "plain":
        assert "phalanx:" in stderr  # its messages still come out where they can


@pytest.mark.parametrize("launcher", ["plain", "run", "self", "ps"])
def test_a_failing_job_with_a_closed_stdout_exits_1_with_its_error(tmp_path, launcher):
    code, _, stderr, _ = _launch(tmp_path, launcher, "stdout", "fail")
    assert code == 1, _logs(tmp_path)
    assert "ValueError: planned failure" in stderr, _logs(tmp_path)
    assert all(frame.endswith("job.py") for frame in _frames(stderr)), stderr  # the program's frames only
    if launcher != "plain":
        assert "root cause (first failure)" in stderr, stderr


@pytest.mark.parametrize("launcher", ["plain", "run", "self", "ps"])
def test_a_write_into_a_closed_pipe_fails_as_in_plain_python(tmp_path, launcher):
    """An unhandled BrokenPipeError ends ``python job.py | head -1`` with status 1 and its
    traceback; under each launcher too, named as the root cause, with no traceback of phalanx's."""
    code, stdout, stderr, _ = _launch(tmp_path, launcher, "pipe", "pipe-unhandled")
    assert code == 1, _logs(tmp_path)
    assert stdout.startswith("line")
    assert "BrokenPipeError" in stderr, _logs(tmp_path)
    assert all(frame.endswith("job.py") for frame in _frames(stderr)), stderr
    if launcher != "plain":
        assert "root cause (first failure)" in stderr, stderr


def test_tee_into_a_closed_pipe_never_fails_the_job(tmp_path):
    """``phalanx run --tee | head -1``: the replicas' lines are phalanx's own output there. Its
    reader going away must not reach the replicas (today the copy stopped, closed the replicas'
    pipe, and replica 0 died of BrokenPipeError) nor block them; the logs stay whole."""
    start = time.monotonic()
    code, stdout, stderr, done = _launch(tmp_path, "run", "pipe", "many", extra=("--tee",))
    assert (code, done) == (0, ["done_0", "done_1"]), _logs(tmp_path)
    assert stdout.startswith("[replica 0] line 0") or stdout.startswith("[replica 1]"), stdout[:200]
    assert "Traceback" not in stderr, stderr
    (log,) = [p for p in (tmp_path / "logs").rglob("replica_0.log")]
    assert log.read_text().count("\n") >= 3000, "the log of replica 0 lost lines"
    assert time.monotonic() - start < 120


def test_sigterm_to_phalanx_run_reaches_a_preemption_handler_and_the_launcher_exits_143(tmp_path):
    """README, Preemption: SIGTERM to ``phalanx run`` is passed to every replica; a
    PreemptionCheckpointHandler saves at an agreed step and the replicas exit 42; the launcher,
    told to stop itself, does not restart them and exits 128 + SIGTERM."""
    job = tmp_path / "job.py"
    job.write_text(
        "import os, sys, time, torch, phalanx as px\n"
        "from phalanx.checkpoint import Checkpoint, CheckpointManager, PreemptionCheckpointHandler\n"
        "s = px.MirroredStrategy()\n"
        "rank = s.extended.process_index\n"
        "with s.scope():\n"
        "    model = torch.nn.Linear(2, 1)\n"
        "manager = CheckpointManager(Checkpoint(model=model), 'ckpts', max_to_keep=1)\n"
        "handler = PreemptionCheckpointHandler(s.cluster_resolver, manager)\n"
        "open(f'attempt_{os.environ[\"PHALANX_RESTART_COUNT\"]}_{rank}', 'w').close()\n"
        "for step in range(6000):\n"
        "    handler.run(s.run, lambda: None)\n"
        "    if step == 0:\n"
        "        open(f'ready_{rank}', 'w').close()\n"
        "    time.sleep(0.01)\n"
    )
    env = {**os.environ, "PHALANX_LOG_ROOT": str(tmp_path / "logs"), "PHALANX_PREEMPTION_GRACE": "20"}
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", "--max-restarts", "2", str(job)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready_{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "received SIGTERM; passing it to 2 task(s)" in out, out
    assert list((tmp_path / "ckpts").glob("ckpt-*")), "the handler saved no checkpoint\n" + out
    assert not list(tmp_path.glob("attempt_1_*")), "the launcher was told to stop: no restart"
