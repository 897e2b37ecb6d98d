"""``phalanx run``: start the replica processes of a job on this host and supervise them.

Process management is torch.distributed.elastic's (``start_processes``): per-process log files,
error files written by the replicas, and termination of the survivors when one fails. phalanx
adds the replica identity (:class:`~phalanx.launch.env.ReplicaEnv`), the "root cause" report
(the earliest failure, with its rank, exit code and traceback tail) and whole-group restarts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
from torch.distributed.elastic.multiprocessing.api import SignalException

from phalanx.launch.env import ReplicaEnv, free_port
from phalanx.launch.self_launch import default_log_dir

RESTART_EXIT_CODE = 42  # a replica asking to be restarted (preemption), as TF's handler does
MAX_PREEMPTION_RESTARTS = 100
PREEMPTION_GRACE_S = 30.0  # how long replicas get to save after the launcher is told to stop


@dataclass(frozen=True)
class JobSpec:
    """What ``phalanx run`` starts on this host.

    Attributes:
        command: the program and its arguments (``["train.py", "--epochs", "3"]``, or ``["-m", "pkg"]``).
        nproc: replica processes on this host.
        nnodes, node_rank, master_addr, master_port: the multi-host layout (1 node by default).
        max_restarts: how many times the whole group is restarted after a failure (with ``ps``:
            how many times each failed worker is restarted).
        ps, workers: when ``ps > 0``, start a parameter-server cluster instead (one chief,
            ``workers`` workers, ``ps`` parameter servers; see :mod:`phalanx.ps.launcher`).
        tls: with ``ps``: TLS between the cluster's tasks, with throwaway certificates (:mod:`phalanx.ps.tls`).
    """

    command: tuple[str, ...]
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    max_restarts: int = 0
    log_dir: str = ""
    ps: int = 0
    workers: int = 0
    tls: bool = False


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return ""


_CONSEQUENCES = ("PeerUnavailableError", "CollectiveTimeoutError")


def _is_consequence(failure: Any) -> bool:
    """Whether a failure only followed another's: the replica reported losing a peer, or it was
    still running (e.g. exiting) when torch elastic stopped the group with SIGTERM."""
    if failure.exitcode == -signal.SIGTERM:
        return True
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message")
    text = message.get("message", "") if isinstance(message, dict) else str(message or "")
    return any(name in text for name in _CONSEQUENCES)


def _root_cause(result, spec: JobSpec) -> tuple[int, str]:
    # Replicas record their uncaught exception (with a timestamp) in elastic's error file; the
    # earliest one is the root cause. A consequence (a replica that saw its peer disappear, or that
    # elastic stopped after another failed) never is when any other failure is there: timestamps
    # have one-second resolution, and a replica still exiting gets SIGTERM once a peer has exited.
    rank, failure = min(result.failures.items(), key=lambda kv: (_is_consequence(kv[1]), kv[1].timestamp, kv[0]))
    global_rank = spec.node_rank * spec.nproc + rank
    detail = ""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message")
    if isinstance(message, dict) and message.get("message"):
        detail = f"error: {message['message']}\n"
    log_tail = _tail(result.stderrs.get(rank, ""), 12) or _tail(result.stdouts.get(rank, ""), 12)
    detail += f"last lines of its log:\n{log_tail}" if log_tail else ""
    code = failure.exitcode
    how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    text = (f"phalanx: root cause (first failure): worker:{spec.node_rank} local rank {rank} "
            f"(global rank {global_rank}, pid {failure.pid}) failed with {how}\n{detail}")
    return (code if code > 0 else 1), text


def run_job(spec: JobSpec) -> int:
    """Runs the job, restarting the whole group up to ``spec.max_restarts`` times; returns the exit code."""
    if spec.ps > 0:
        from phalanx.ps.launcher import ClusterJob, run_cluster

        return run_cluster(ClusterJob(spec.command, spec.ps, spec.workers, spec.max_restarts, spec.log_dir,
                                      tls=spec.tls))
    run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    log_dir = spec.log_dir or default_log_dir(run_id)
    os.makedirs(log_dir, exist_ok=True)
    print(f"phalanx: {spec.nproc} replica(s) on this host; logs in {log_dir}", file=sys.stderr, flush=True)
    stop = {"signal": None}

    def on_signal(signum, frame):  # noqa: ANN001
        stop["signal"] = signum
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        attempt = failures = preemptions = 0
        while True:
            code = _run_attempt(spec, run_id, log_dir, attempt)
            if code == 0:
                return 0
            attempt += 1
            # A preempted job (every replica saved and asked for a restart) did not fail: it does
            # not use up --max-restarts, though a bound keeps a job that always asks from looping.
            if code == RESTART_EXIT_CODE and preemptions < MAX_PREEMPTION_RESTARTS:
                preemptions += 1
                print("phalanx: the job saved and asked to be restarted (preemption); restarting",
                      file=sys.stderr, flush=True)
                continue
            if failures >= spec.max_restarts:
                return code
            failures += 1
            print(f"phalanx: restarting the job (restart {failures} of {spec.max_restarts})",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        return 128 + (stop["signal"] or signal.SIGINT)
    except SignalException as e:  # torch elastic's own handler fired while its processes ran
        return 128 + int(e.sigval)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _run_attempt(spec: JobSpec, run_id: str, log_dir: str, attempt: int) -> int:
    port = spec.master_port or free_port(spec.master_addr)
    world = spec.nproc * spec.nnodes
    envs, args = {}, {}
    for local in range(spec.nproc):
        env = ReplicaEnv(rank=spec.node_rank * spec.nproc + local, world_size=world, local_rank=local,
                         local_world_size=spec.nproc, master_addr=spec.master_addr, master_port=port,
                         node_rank=spec.node_rank, num_nodes=spec.nnodes, run_id=run_id, log_dir=log_dir)
        envs[local] = {**env.to_environ(), "PHALANX_RESTART_COUNT": str(attempt), "PYTHONUNBUFFERED": "1"}
        args[local] = tuple(spec.command)
    # Replica 0 of the first node writes to the terminal (and its log); the others only to logs.
    tee = {r: (Std.ALL if r == 0 and spec.node_rank == 0 else Std.NONE) for r in range(spec.nproc)}
    redirects = {r: Std.ALL for r in range(spec.nproc)}
    ctx = start_processes(name=f"phalanx-{attempt}", entrypoint=sys.executable, args=args, envs=envs,
                          logs_specs=DefaultLogsSpecs(log_dir=os.path.join(log_dir, f"attempt_{attempt}"),
                                                      redirects=redirects, tee=tee))
    try:
        while True:
            result = ctx.wait(timeout=0.1, period=0.05)
            if result is None:
                continue
            if not result.is_failed():
                return 0
            code, text = _root_cause(result, spec)
            print(text, file=sys.stderr, flush=True)
            return code
    except (KeyboardInterrupt, SignalException):
        # This launcher is being stopped (SIGTERM: preemption, SIGINT: Ctrl-C). Pass the notice on,
        # so replicas with a PreemptionCheckpointHandler can agree on a step and save, then wait for
        # them a bounded time before killing what is left.
        ctx.close(death_sig=signal.SIGTERM, timeout=PREEMPTION_GRACE_S)
        raise
    finally:
        ctx.close(death_sig=signal.SIGKILL)
