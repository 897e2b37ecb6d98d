"""``phalanx run --ps M --workers N train.py``: a parameter-server cluster on this host.

Starts one ``chief``, N ``worker`` and M ``ps`` processes of the same command. Each gets a
``TF_CONFIG`` naming the whole cluster on 127.0.0.1 (free ports) and its own task, and every
process gets the same ``PHALANX_CLUSTER_SECRET`` (a fresh random one unless it is set already).
The chief writes to the terminal; the others to ``<log dir>/<task>.log``.

Supervision follows TF's fault model: a worker that exits is restarted on the same address up to
``max_restarts`` times (the coordinator reconnects and gives it new work); a parameter server is
not restarted (its variables are gone: the coordinator reports it and the job restarts from a
checkpoint). The job ends with the chief: the servers exit when its coordinator shuts the
cluster down; any still running after ``shutdown_grace`` seconds are stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from phalanx.launch.env import free_port
from phalanx.launch.self_launch import _die_with_parent, default_log_dir
from phalanx.ps.wire import SECRET_ENV, generate_secret


@dataclass(frozen=True)
class ClusterJob:
    """What ``phalanx run --ps`` starts."""

    command: tuple[str, ...]
    num_ps: int
    num_workers: int
    max_restarts: int = 0
    log_dir: str = ""
    host: str = "127.0.0.1"
    shutdown_grace: float = 10.0
    tls: bool = False


def _threads(task_type: str, num_workers: int) -> str:
    # Workers share this host's cores; servers and the chief mostly wait on the network.
    cores = os.cpu_count() or 1
    return "1" if task_type == "ps" else str(max(1, cores // num_workers))


class _Cluster:
    def __init__(self, job: ClusterJob) -> None:
        self.job = job
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.log_dir = job.log_dir or default_log_dir(self.run_id)
        os.makedirs(self.log_dir, exist_ok=True)
        tasks = [("chief", 0)] + [("worker", i) for i in range(job.num_workers)] + [("ps", i) for i in range(job.num_ps)]
        ports = {t: free_port(job.host) for t in tasks}
        self.cluster = {kind: [f"{job.host}:{ports[(kind, i)]}" for i in range(n)]
                        for kind, n in (("chief", 1), ("worker", job.num_workers), ("ps", job.num_ps))}
        self.secret = os.environ.get(SECRET_ENV) or generate_secret()
        self.tasks = tasks
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.restarts = {t: 0 for t in tasks}
        self.reported: set[tuple[str, int]] = set()

    def tls_env(self) -> dict[str, str]:
        """With ``--tls``: a throwaway CA and certificate for this run (``<log dir>/tls``), as PHALANX_TLS_*."""
        if not self.job.tls:
            return {}
        if not hasattr(self, "_tls_env"):
            from phalanx.ps.tls import generate_local

            self._tls_env = generate_local(os.path.join(self.log_dir, "tls"), hosts=(self.job.host, "localhost"))
        return self._tls_env

    def log_path(self, task: tuple[str, int]) -> str:
        return os.path.join(self.log_dir, f"{task[0]}_{task[1]}.log")

    def start(self, task: tuple[str, int]) -> None:
        kind, index = task
        env = dict(os.environ)
        env.update({
            "TF_CONFIG": json.dumps({"cluster": self.cluster, "task": {"type": kind, "index": index}}),
            SECRET_ENV: self.secret,
            "PHALANX_RESTART_COUNT": str(self.restarts[task]),
            "PYTHONUNBUFFERED": "1",
            **self.tls_env(),
        })
        env.setdefault("OMP_NUM_THREADS", _threads(kind, self.job.num_workers))
        if kind == "chief":
            out = None
        else:
            out = open(self.log_path(task), "ab")  # noqa: SIM115 - the child owns it from here
        try:
            self.procs[task] = subprocess.Popen([sys.executable, *self.job.command], env=env, stdout=out,
                                                stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                                preexec_fn=_die_with_parent)
        finally:
            if out is not None:
                out.close()

    def supervise(self) -> int:
        chief = ("chief", 0)
        while True:
            code = self.procs[chief].poll()
            if code is not None:
                return code
            for task, proc in self.procs.items():
                rc = proc.poll()
                if task == chief or rc is None:
                    continue
                if task[0] == "worker" and rc != 0 and self.restarts[task] < self.job.max_restarts:
                    self.restarts[task] += 1
                    print(f"phalanx: {task[0]}:{task[1]} exited with {_how(rc)}; restarting it "
                          f"({self.restarts[task]} of {self.job.max_restarts})", file=sys.stderr, flush=True)
                    self.start(task)
                elif task not in self.reported:
                    self.reported.add(task)
                    if rc == 0:
                        continue  # told to stop by the coordinator: the chief is ending too
                    print(f"phalanx: {task[0]}:{task[1]} exited with {_how(rc)}; last lines of "
                          f"{self.log_path(task)}:\n{_tail(self.log_path(task))}", file=sys.stderr, flush=True)
            time.sleep(0.05)

    def stop(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        alive = [p for p in self.procs.values() if p.poll() is None]
        if alive:
            print(f"phalanx: stopping {len(alive)} task(s) still running after the chief ended",
                  file=sys.stderr, flush=True)
        for p in alive:
            p.terminate()
        for p in alive:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _tail(path: str, lines: int = 12) -> str:
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return "(no log)"


def run_cluster(job: ClusterJob) -> int:
    """Runs the cluster until the chief ends; returns the chief's exit code."""
    if job.num_ps < 1 or job.num_workers < 1:
        raise ValueError(f"a parameter-server cluster needs --ps >= 1 and --workers >= 1; received "
                         f"ps={job.num_ps}, workers={job.num_workers}")
    cluster = _Cluster(job)
    print(f"phalanx: chief + {job.num_workers} worker(s) + {job.num_ps} parameter server(s) on {job.host}; "
          f"logs in {cluster.log_dir}", file=sys.stderr, flush=True)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for task in cluster.tasks:
            cluster.start(task)
        code = cluster.supervise()
        cluster.stop(job.shutdown_grace)
        return code if code >= 0 else 128 - code
    except KeyboardInterrupt:
        cluster.stop(0.0)
        return 128 + (stop["signal"] or signal.SIGINT)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
