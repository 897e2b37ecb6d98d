"""Hangs and mismatches that explain themselves (issue 47): real jobs, one diagnosis on the launcher's terminal.

Each case is a 2-replica job of ``scripts/hangs.py`` in one of the ways a data-parallel job hangs or
parts, started as a user would: ``python hangs.py`` (self-launch), ``phalanx run -n 2``, or two
``TF_CONFIG`` workers of MultiWorkerMirroredStrategy. The terminal of the job's launcher must name
the right replica (the one that never arrived or made another call, never the one that waited) and
the right source line (looked up by its marker comment in the script), within the collective
timeout plus a few seconds, and keep the diagnosis in the run directory for ``phalanx diagnose``.
A slow replica is not called stuck (``phalanx diagnose --live`` on a running job), and chief-only
work longer than the timeout fails without ``phalanx.wait_for_chief`` and runs with it.

The jobs run a few at a time (they mostly wait out their timeouts); each test reads its own job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_ports, run_jobs, start_process, tf_config

SCRIPT = Path(__file__).parent / "scripts" / "hangs.py"
TIMEOUT = 8.0  # PHALANX_COLLECTIVE_TIMEOUT of the jobs (a crowded 2-core host delays a start by seconds)
CHIEF_S = 13.0  # the chief's evaluation: well past the timeout
# From the moment the trouble starts to the job's end, its diagnosis printed: the timeout, the
# replicas' answers (a heartbeat and a CPU sample), the launcher's wait for the cause and its stop.
BOUND = TIMEOUT + 10.0
AT_ONCE = 2
ENV = {"PHALANX_COLLECTIVE_TIMEOUT": str(TIMEOUT), "OMP_NUM_THREADS": "1", "HANG_CHIEF_S": str(CHIEF_S)}


def line_of(marker: str) -> str:
    """``hangs.py:<n>``: where the script's line marked ``# @<marker>`` is."""
    for n, text in enumerate(SCRIPT.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# @{marker}"):
            return f"hangs.py:{n}"
    raise AssertionError(f"no line marked @{marker}")


def _command(launcher: str) -> list[str]:
    if launcher == "run":
        return [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(SCRIPT)]
    return [sys.executable, str(SCRIPT)]


CASES = {  # name -> (launcher, HANG_MODE)
    "sleep-self": ("self", "sleep"),
    "sleep-run": ("run", "sleep"),
    "pipe-self": ("self", "pipe"),
    "extra-self": ("self", "extra"),
    "extra-run": ("run", "extra"),
    "missing-self": ("self", "missing"),
    "shape-self": ("self", "shape"),
    "bucket_order-self": ("self", "bucket_order"),
    "skip-self": ("self", "skip"),
    "kill-self": ("self", "kill"),
    "kill-run": ("run", "kill"),
    "chief-self": ("self", "chief"),
    "chief-run": ("run", "chief"),
    "chief_declared-self": ("self", "chief_declared"),
}


class Job:
    """A finished job: its launcher's output, exit status, run directory and when its trouble began."""

    def __init__(self, folder: Path, result, ended: float) -> None:
        self.folder, self.code, self.output, self.ended = folder, result.returncode, result.output, ended
        runs = sorted(p for p in result.log_dir.glob("*") if p.is_dir()) if result.log_dir.exists() else []
        self.run_dir = runs[-1] if runs else None
        events = [float(p.read_text()) for p in folder.glob("t_event_*")]
        self.event = min(events) if events else None

    def cause(self) -> str:
        parts = self.output.split("phalanx: root cause (first failure): ")
        assert len(parts) == 2, f"not one root cause:\n{self.output[-6000:]}"
        return parts[1].split("\nphalanx: ")[0]

    def diagnosis(self) -> str:
        """The diagnosis block the launcher printed."""
        parts = self.output.split("phalanx: diagnosis")
        assert len(parts) == 2, f"not one diagnosis:\n{self.output[-6000:]}"
        return parts[1].split("\nphalanx: ")[0]

    def took(self) -> float:
        assert self.event is not None, self.output[-4000:]
        return self.ended - self.event


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """case -> its :class:`Job`. The cases run ``AT_ONCE`` at a time, in the order of ``CASES``; a
    case's batch runs when a test first asks for one of its cases (``-k`` runs only what it needs)."""
    names = list(CASES)
    batches = [names[at : at + AT_ONCE] for at in range(0, len(names), AT_ONCE)]
    done: dict[str, Job] = {}

    def get(name: str) -> Job:
        if name not in done:
            batch = next(b for b in batches if name in b)
            cwd = tmp_path_factory.mktemp("hangs")
            folders = [cwd / n for n in batch]
            commands = []
            for n, folder in zip(batch, folders):
                folder.mkdir()
                commands.append((_command(CASES[n][0]), {**ENV, "HANG_MODE": CASES[n][1], "HANG_DIR": str(folder)}))
            started = time.time()
            results = run_jobs(commands, timeout=150, cwd=cwd)
            for n, folder, result in zip(batch, folders, results):
                done[n] = Job(folder, result, started + result.elapsed)
                print(f"\n{n}: exit {result.returncode}\n{result.output[-3000:]}")
        return done[name]

    return get


# ----------------------------------------------------------------------------- a replica that never arrives
@pytest.mark.parametrize("case", ["sleep-self", "sleep-run", "pipe-self"])
def test_a_replica_blocked_in_its_own_code_is_named_with_its_line(jobs, case):
    job = jobs(case)
    marker = "SLEEP" if case.startswith("sleep") else "PIPE"
    assert job.code == 1, job.output[-6000:]
    cause = job.cause()
    assert cause.startswith("replica 1") and "never arrived" in cause and line_of(marker) in cause, cause
    assert "blocked" in cause, cause
    block = job.diagnosis()
    assert line_of(marker) in block and "<- the cause" in block.split(line_of(marker))[1].splitlines()[0], block
    # The replica that waited is named waiting in the step's gradient all-reduce, from its backward line.
    assert "waited" in block and "gradient all-reduce" in block and line_of("BACKWARD") in block, block
    assert "PHALANX_COLLECTIVE_TIMEOUT" in block, block
    assert job.took() < BOUND, (job.took(), job.output[-4000:])


def test_the_diagnosis_is_kept_in_the_run_directory_and_printed_again(jobs):
    job = jobs("sleep-self")
    assert job.run_dir is not None and (job.run_dir / "diagnosis.json").exists(), job.output[-3000:]
    again = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "diagnose", str(job.run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    printed = [line for line in job.diagnosis().splitlines()[1:] if line.strip()]
    assert printed and all(line in again.stdout for line in printed), (again.stdout, printed)


# ----------------------------------------------------------------------------- collectives that part
@pytest.mark.parametrize("case", ["extra-self", "extra-run"])
def test_an_extra_reduce_names_its_line_and_the_line_the_other_replica_was_at(jobs, case):
    job = jobs(case)
    assert job.code == 1, job.output[-6000:]
    cause = job.cause()
    assert cause.startswith("replica 1") and "an extra collective" in cause and line_of("EXTRA") in cause, cause
    assert "skipped or repeated" not in job.output, job.output[-6000:]  # no step was skipped
    block = job.diagnosis()
    assert line_of("EXTRA") in block and line_of("REDUCE") in block, block  # both lines
    assert job.took() < BOUND, (job.took(), job.output[-4000:])


def test_a_missing_gather_names_the_replica_that_skipped_it_and_both_lines(jobs):
    job = jobs("missing-self")
    assert job.code == 1, job.output[-6000:]
    cause = job.cause()
    assert cause.startswith("replica 1") and "a missing collective" in cause, cause
    assert line_of("GATHER") in cause and line_of("BACKWARD") in cause, cause
    assert job.took() < BOUND, (job.took(), job.output[-4000:])


def test_a_collective_with_another_shape_names_the_line_and_both_sizes(jobs):
    job = jobs("shape-self")
    assert job.code == 1, job.output[-6000:]
    cause = job.cause()
    assert "another shape" in cause and line_of("SHAPE") in cause, cause
    assert "12 float32 on replica:0 (rank 0)" in cause and "11 float32 on replica:1 (rank 1)" in cause, cause
    assert job.took() < BOUND, (job.took(), job.output[-4000:])


def test_gradient_buckets_in_another_order_are_named_at_the_backward_line(jobs):
    job = jobs("bucket_order-self")
    assert job.code == 1, job.output[-6000:]
    cause = job.cause()
    assert "gradient buckets that differ" in cause and line_of("BACKWARD") in cause, cause
    assert "created in the same order" in job.diagnosis(), job.diagnosis()


def test_a_skipped_step_says_so_and_names_the_replica_that_skipped_it(jobs):
    job = jobs("skip-self")
    assert job.code == 1, job.output[-6000:]
    cause = job.cause()
    assert cause.startswith("replica 1") and "a skipped step" in cause and "step 5" in cause, cause
    assert "ReplicaDivergenceError" in job.output and line_of("BACKWARD") in cause, job.output[-6000:]


# ----------------------------------------------------------------------------- a dead replica
@pytest.mark.parametrize("case", ["kill-self", "kill-run"])
def test_a_killed_replica_is_named_with_its_signal(jobs, case):
    job = jobs(case)
    assert job.code != 0, job.output[-6000:]
    cause = job.cause()
    assert cause.startswith("replica 1") and "killed by signal SIGKILL" in cause, cause
    assert "dead" in job.diagnosis(), job.diagnosis()
    assert job.took() < BOUND, (job.took(), job.output[-4000:])


# ----------------------------------------------------------------------------- busy is not stuck
@pytest.mark.parametrize("case", ["chief-self", "chief-run"])
def test_chief_only_work_past_the_timeout_is_named_busy_with_the_setting_and_the_way_out(jobs, case):
    job = jobs(case)
    assert job.code == 1, job.output[-6000:]
    cause = job.cause()
    assert cause.startswith("replica 0") and "busy, not stuck" in cause and line_of("EVALUATE") in cause, cause
    block = job.diagnosis()
    assert f"PHALANX_COLLECTIVE_TIMEOUT ({TIMEOUT:g} s)" in block and "phalanx.wait_for_chief()" in block, block
    assert job.took() < CHIEF_S + 4.0, (job.took(), job.output[-4000:])  # not after the chief's work


def test_chief_only_work_declared_with_wait_for_chief_runs_past_the_timeout(jobs):
    job = jobs("chief_declared-self")
    assert job.code == 0, job.output[-6000:]
    assert "done 0" in job.output and "root cause" not in job.output, job.output[-4000:]
    assert job.took() > CHIEF_S, job.took()  # the others did wait for the whole evaluation


# ----------------------------------------------------------------------------- MultiWorkerMirrored, TF_CONFIG
def test_a_tf_config_worker_that_never_arrives_is_named_on_the_other_workers_terminal(tmp_path):
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    jobs_ = [
        (
            [sys.executable, str(SCRIPT)],
            {**ENV, **tf_config(workers, i), "HANG_MODE": "sleep", "HANG_DIR": str(tmp_path)},
        )
        for i in range(2)
    ]
    started = time.time()
    res = run_jobs(jobs_, timeout=120, cwd=tmp_path, wait_for=[0])[0]  # worker 1 sleeps on: ended after
    out = res.output
    assert res.returncode == 1, out[-6000:]
    # No launcher watches these workers: worker 0 prints the diagnosis itself, and its error names worker 1.
    assert "phalanx: diagnosis of CollectiveTimeoutError on worker:0 (rank 0)" in out, out[-6000:]
    assert f"worker:1 (rank 1) is unavailable (worker:1 (rank 1) is in its own code at {line_of('SLEEP')}" in out, out
    assert started + res.elapsed - float((tmp_path / "t_event_0").read_text()) < BOUND, out[-3000:]


def test_a_chief_that_dies_inside_wait_for_chief_ends_the_wait_at_once(tmp_path):
    """The wait is bounded by the chief's liveness, not by the clock: its death is seen in a moment."""
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    env = {**ENV, "HANG_MODE": "chief_dies", "HANG_DIR": str(tmp_path)}
    started = time.time()
    chief, other = run_jobs(
        [([sys.executable, str(SCRIPT)], {**env, **tf_config(workers, i)}) for i in range(2)], timeout=120, cwd=tmp_path
    )
    assert chief.returncode == -9, chief.output[-3000:]
    assert other.returncode == 1, other.output[-6000:]
    assert "PeerUnavailableError: waiting for the chief's evaluation on worker:1 (rank 1)" in other.output, other.output
    assert "worker:0 (rank 0) is unavailable" in other.output, other.output
    # The chief died 1 s into the block: the other worker ends long before any timeout would.
    took = started + other.elapsed - float((tmp_path / "t_event_1").read_text())
    assert took < 1.0 + TIMEOUT / 2, (took, other.output[-3000:])


# ----------------------------------------------------------------------------- a slow replica, seen live
def test_a_slow_replica_is_not_called_stuck_and_the_job_runs_on(tmp_path):
    env = {**os.environ, **ENV, "HANG_MODE": "slow", "HANG_STEPS": "16", "HANG_SLOW_S": "0.5"}
    env.update(PHALANX_LOG_ROOT=str(tmp_path / "logs"), PYTHONUNBUFFERED="1", HANG_DIR=str(tmp_path))
    env.pop("PYTEST_CURRENT_TEST", None)
    with open(tmp_path / "job.out", "w") as out:
        job = start_process(_command("run"), cwd=tmp_path, env=env, out=out)
        try:
            deadline = time.monotonic() + 90
            while not (tmp_path / "step_1").exists() or int((tmp_path / "step_1").read_text() or 0) < 3:
                assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.out").read_text()
                time.sleep(0.1)
            (run_dir,) = [p for p in (tmp_path / "logs").iterdir() if p.is_dir()]
            live = subprocess.run(
                [sys.executable, "-m", "phalanx.cli", "diagnose", "--live", str(run_dir)],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
            code = job.wait(timeout=120)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    output = (tmp_path / "job.out").read_text()
    print(f"\nlive view of a slow job:\n{live.stdout}{live.stderr}")
    assert code == 0 and "done 0" in output and "root cause" not in output, output[-4000:]
    assert live.returncode == 0, live.stderr
    view = live.stdout
    assert view.startswith("live view of the job (nothing was stopped)"), view
    assert "replica:0 (rank 0)" in view and "replica:1 (rank 1)" in view, view
    for word in ("stuck", "never arrived", "the cause", "failed"):
        assert word not in view, view
    # Replica 1 is seen in its slow line, or replica 0 waiting for it in a collective.
    assert line_of("SLOW") in view or "waits (" in view, view
