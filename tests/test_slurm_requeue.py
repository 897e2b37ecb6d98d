"""Slurm: a job told its time is running out saves at an agreed step, is requeued and resumes.

The real test starts a one-node Slurm cluster on this machine (munged, slurmctld and slurmd from
Debian's ``slurm-wlm``, each in the foreground as this test's child, on ports of its own, with a
configuration and state in a temporary directory) and submits docs/deploy/slurm-requeue.sbatch
with ``sbatch``, 2 tasks on the one node: once as it is (the uninterrupted run), once with
``--time=2 --signal=USR1@30``. Slurm sends SIGUSR1 to both tasks before the time limit; they
stop after the same step, save, exit with 42, the script requeues the job, and the requeued job
resumes from the checkpoint, until the run ends with the uninterrupted run's parameters. It skips,
saying why, where Slurm is not installed or cannot start (not root, no munge).

The others emulate the environment Slurm gives a task (no daemons): the bad inputs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

import phalanx as px
from phalanx.checkpoint import Checkpoint, CheckpointManager, PreemptionCheckpointHandler, TerminationConfig
from phalanx.checkpoint.errors import CheckpointNotFoundError
from phalanx.errors import ClusterSpecError

from conftest import free_ports, run_jobs

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "deploy"
_DONE = re.compile(r"done: task (\S+), (\d+) replicas, final loss (\S+), parameters (\w+)")


def _slurm_env(monkeypatch, **extra: str) -> None:
    """What srun gives task 0 of a 2-task step on two nodes (one task each), plus ``extra``."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_JOB_NODELIST": "pxnode[1-2]",
        "SLURM_STEP_NODELIST": "pxnode[1-2]",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURMD_NODENAME": "pxnode1",
        **extra,
    }
    for k in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_a_slurm_step_whose_tasks_per_node_differ_from_the_strategy_devices_is_a_typed_error(monkeypatch):
    _slurm_env(monkeypatch)
    # Before: each task started 2 replicas of its own, two jobs that never met.
    with pytest.raises(ClusterSpecError, match=r"SLURM_NTASKS_PER_NODE='1'.*2 devices \['cpu:0', 'cpu:1'\]") as e:
        px.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    assert (e.value.key, e.value.value) == ("SLURM_NTASKS_PER_NODE", "1")


def _handler(directory: Path) -> PreemptionCheckpointHandler:
    manager = CheckpointManager(Checkpoint(w=torch.zeros(1)), str(directory), max_to_keep=1)

    def stop() -> None:
        raise SystemExit(42)

    return PreemptionCheckpointHandler(None, manager, termination_config=TerminationConfig(exit_fn=stop))


def test_a_requeued_job_without_its_checkpoint_is_a_typed_error_naming_the_directory(monkeypatch, tmp_path):
    _slurm_env(monkeypatch, SLURM_RESTART_COUNT="1")
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with pytest.raises(CheckpointNotFoundError, match="SLURM_RESTART_COUNT=1") as e:
        _handler(tmp_path / "checkpoints")
    assert e.value.path == str(tmp_path / "checkpoints")
    assert {s: signal.getsignal(s) for s in before} == before  # the handler put its signals back


def test_under_slurm_sigusr1_is_the_notice_to_save(monkeypatch, tmp_path):
    _slurm_env(monkeypatch)
    handler = _handler(tmp_path)
    try:
        handler.run(lambda: None)
        os.kill(os.getpid(), signal.SIGUSR1)  # what --signal=USR1@N sends: noted, not fatal
        with pytest.raises(SystemExit):
            handler.run(lambda: None)
    finally:
        handler.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert (tmp_path / "ckpt-1" / "MANIFEST.json").exists()


# --------------------------------------------------------------------------- a real Slurm cluster
class SlurmCluster:
    """munged, slurmctld and slurmd on this machine, one node, in a directory of their own."""

    def __init__(self) -> None:
        for tool in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol"):
            if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
                pytest.skip(f"Slurm is not installed ({tool} not found): apt-get install slurm-wlm munge")
        if os.geteuid() != 0:
            pytest.skip("slurmd must run as root to start jobs")
        # Short: munge's and Slurm's sockets live here (a Unix socket path has at most 107 bytes).
        self.dir = Path(tempfile.mkdtemp(prefix="pxslurm-"))
        self.dir.chmod(0o755)  # munged wants its socket's directory reachable by everyone
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}
        self.env.pop("PYTEST_CURRENT_TEST", None)
        for k in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            self.env.pop(k)  # this test may itself run inside a Slurm job
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"  # srun's `python`
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(px.__file__).parents[1]), os.environ.get("PYTHONPATH")) if p
        )

    def start(self) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld_port, slurmd_port = free_ports(2)
        host = socket.gethostname()
        (d / "slurm.conf").write_text(
            f"""ClusterName=pxtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""
        )
        munged = shutil.which("munged") or "/usr/sbin/munged"
        self._daemon(
            [munged, "-F", "--force", f"--socket={d}/munge.sock", f"--key-file={key}", f"--pid-file={d}/munged.pid"]
            + [f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
            d / "munge.sock",
        )
        conf = str(d / "slurm.conf")
        self._daemon([shutil.which("slurmctld") or "/usr/sbin/slurmctld", "-D", "-i", "-f", conf], None)
        self._daemon([shutil.which("slurmd") or "/usr/sbin/slurmd", "-D", "-f", conf], None)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True, timeout=10)
            if r.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        pytest.skip(f"Slurm did not start within 30 s: {self.logs()}")

    def _daemon(self, cmd: list[str], ready: Path | None) -> None:
        out = open(self.dir / f"{Path(cmd[0]).name}.out", "w")  # noqa: SIM115 - the daemon's, closed with it
        self.procs.append(
            subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        )
        out.close()
        deadline = time.monotonic() + 10
        while ready is not None and not ready.exists():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"{Path(cmd[0]).name} did not start: {self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out"))
        )

    def run(self, *cmd: str, cwd: Path | None = None) -> str:
        r = subprocess.run(list(cmd), env=self.env, cwd=cwd, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{cmd}: {r.stderr}\n{self.logs()}"
        return r.stdout

    def wait(self, job: str, timeout: float) -> dict[str, str]:
        """Waits for ``job`` to end, starting it at once after each requeue; its final fields."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run("squeue", "-h", "-j", job, "-o", "%T %r").strip()
            if not state:
                break
            if state == "PENDING BeginTime":  # a requeued job is held ~2 min before it may start again
                self.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            time.sleep(1)
        else:
            pytest.fail(f"job {job} did not end within {timeout} s\n{self.logs()}")
        fields = self.run("scontrol", "show", "job", job)
        return dict(re.findall(r"(\w+)=(\S*)", fields))

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--quiet", "-u", "root"], env=self.env, timeout=30, check=False)
        # slurmctld and slurmd end themselves and reap their helpers (slurmctld's slurmscriptd, which a
        # plain SIGTERM leaves a zombie); munged, and whatever does not end, is stopped here.
        subprocess.run(["scontrol", "shutdown"], env=self.env, timeout=30, check=False, capture_output=True)
        for p in reversed(self.procs):
            try:
                p.wait(0 if p is self.procs[0] else 15)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()  # a slurmstepd of a job cancelled above
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def slurm():
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _done(output: str) -> list[tuple[str, str]]:
    """``(task, parameters digest)`` of each task's last line (a task is a node: both say worker:0)."""
    return sorted((m[1], m[4]) for m in _DONE.finditer(output))


@pytest.mark.timeout(600)
def test_a_job_signalled_before_its_time_limit_saves_requeues_and_ends_where_an_uninterrupted_run_ends(slurm, tmp_path):
    work = tmp_path / "job"
    work.mkdir()
    for name in ("slurm-requeue.sbatch", "train.py"):
        shutil.copy(DEPLOY / name, work / name)
    # One node of 2 CPUs: the recipe's 2 tasks on it, one CPU each.
    one_node = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
    steps = ["--steps", "200"]
    plain = slurm.run("sbatch", "--parsable", *one_node, "slurm-requeue.sbatch", *steps, cwd=work).strip()
    assert slurm.wait(plain, timeout=150)["JobState"] == "COMPLETED", slurm.logs()
    reference = _done((work / f"phalanx-train-{plain}.out").read_text())
    assert len(reference) == 2 and len(set(reference)) == 1, reference

    # Slurm checks time limits every 30 s and sends the warning once at most N + 30 s are left
    # ("up to 60 s earlier than specified", its manual says): with 2 minutes and USR1@30 it comes
    # 60 to 90 s into the run (not while Python is still starting, which SIGUSR1 would kill), and
    # 0.5 s per step makes the run outlast it. The requeued run ends before its own warning.
    limited = ["--time=2", "--signal=USR1@30"]
    job = slurm.run(
        "sbatch", "--parsable", *one_node, *limited, "slurm-requeue.sbatch", *steps, "--step-seconds", "0.5", cwd=work
    ).strip()
    fields = slurm.wait(job, timeout=360)
    output = (work / f"phalanx-train-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, f"{fields}\n{output}"
    assert "termination notice received here; all processes stopped after step" in output, output
    resumed = re.findall(r"task (\S+): resumed at step (\d+)", output)
    assert len(resumed) >= 2 and all(int(step) > 0 for _, step in resumed), output
    assert _done(output) == reference, output  # bitwise: the checkpoint carries every value on


def test_mirrored_strategy_in_a_slurm_step_runs_one_replica_per_task(tmp_path):
    """2 tasks of one node, as srun starts them: one job of 2 replicas (before: two jobs of 2 each)."""
    (port,) = free_ports(1)
    host = socket.gethostname()
    env = {
        "SLURM_JOB_ID": "4243",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": host,
        "SLURM_STEP_NODELIST": host,
        "SLURM_NODEID": "0",
        "SLURMD_NODENAME": host,
        "MASTER_PORT": str(port),
        "KERAS_BACKEND": "torch",
    }
    script = Path(__file__).parent / "scripts" / "slurm_mirrored.py"
    jobs = [([sys.executable, str(script)], {**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in (0, 1)]
    results = run_jobs(jobs, timeout=90, cwd=tmp_path)
    for r in results:
        assert r.returncode == 0, r.logs()
    assert sorted(r.output.strip().splitlines()[-1] for r in results) == [
        "replicas 2, process 0, sum 3",
        "replicas 2, process 1, sum 3",
    ], [r.output for r in results]
