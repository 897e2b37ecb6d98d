"""Every ``PHALANX_*`` setting and every timeout default, in one frozen dataclass.

A strategy (or any other reader) takes one :class:`Settings` snapshot, with :func:`settings`, when
it is built and reads its values from it, so one object says what the process was configured
with, and a malformed value fails with the variable's name before any work starts.

The launcher's identity variables (``PHALANX_RANK``, ``PHALANX_WORLD_SIZE``, ...) are not settings:
:class:`phalanx.launch.env.ReplicaEnv` reads them.

Example:
    >>> from phalanx.config import Settings
    >>> s = Settings.from_environ({"PHALANX_RPC_TIMEOUT": "5"})
    >>> s.rpc_timeout, s.collective_timeout, s.central_copy
    (5.0, 300.0, False)
    >>> Settings.from_environ({"PHALANX_RPC_TIMEOUT": "soon"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    phalanx.errors.ClusterSpecError: ...PHALANX_RPC_TIMEOUT...
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field, fields
from typing import Mapping

from phalanx.errors import ClusterSpecError

# Timeout defaults, in seconds: the one place they are written.
COLLECTIVE_TIMEOUT = 300.0  # one collective; CommunicationOptions(timeout_seconds=...) overrides
RENDEZVOUS_TIMEOUT = 120.0  # every process of the job (or every parameter server) to show up
RENDEZVOUS_NOTICE = 5.0  # a task still waiting at rendezvous then says for whom, once
RPC_TIMEOUT = 30.0  # one call to a parameter server or worker
ORPHAN_TIMEOUT = 300.0  # a ps/worker task with no word from its coordinator exits
WORKER_RECOVERY_TIMEOUT = 600.0  # the coordinator waits this long for any worker to come back
SHM_TIMEOUT = 30.0  # a peer's turn in the shared-memory all-reduce
GROUP_TIMEOUT = 60.0  # GroupSpec's default when a caller builds one by hand
EXIT_TIMEOUT = 10.0  # the other replicas finish after replica 0 finished normally, or the job fails
STOP_GRACE = 1.5  # a stopped replica, between SIGTERM/SIGINT and SIGKILL, when a job fails or is interrupted
PREEMPTION_GRACE = 30.0  # replicas save after the launcher received SIGTERM
KEEP_RUNS = 10  # run directories kept under the log root
CLOCK_SKEW = 60.0  # how far a signed frame's time may be from the receiver's clock
# Steps between two parameter fingerprints of the consistency guard (phalanx.comm.guard): at most
# 1 % of a step on the benchmark models (benchmarks/fingerprint.py), drift named within 100 steps.
FINGERPRINT_EVERY = 100
# Passes between two checks of the guard's fields on a GPU (phalanx.comm.guard.ReplicaGuard.rides):
# there a check costs two copies between host and device and their events, 100-300 us of host time
# on an H200 (benchmarks/gpu/guard_parts.py), 5-10 % of a host-bound 2 ms step; every 8th pass it
# is about 1 %, and a mismatch is raised at most 8 passes late. On a CPU every pass (a few us).
GUARD_EVERY_GPU = 8
# Collectives each replica's flight recorder keeps (phalanx.comm.flight_recorder): a few steps of a
# model with a dozen gradient buckets, for the diagnosis of a hang or of collectives that part.
FLIGHT_RECORDER = 128
# The signal that makes a launched replica write every thread's Python stack to its log. Not
# SIGUSR1: Slurm sends that before a job's time runs out (--signal=USR1@60), for the program to save.
STACK_SIGNAL = "SIGUSR2"
# Signals that cannot carry a stack dump: uncatchable, phalanx's own stop signals, the ones
# faulthandler keeps for crashes, and those the kernel sends for other reasons.
_NOT_FOR_STACKS = frozenset(
    ("SIGKILL", "SIGSTOP", "SIGTERM", "SIGINT", "SIGCHLD", "SIGCONT")  # uncatchable, phalanx's stops, the kernel's
    + ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL")  # faulthandler's own, for crashes
)


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ClusterSpecError(name, raw, "must be a number of seconds") from None
    if not value > 0:
        raise ClusterSpecError(name, raw, "must be positive")
    return value


def _signal_name(name: str, raw: str) -> str:
    """A signal given by name (``SIGUSR2``, ``USR2``, any case) or number, as its ``SIG`` name."""
    text = raw.strip().upper()
    try:
        named = text if text.startswith("SIG") else "SIG" + text
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[named]
    except (KeyError, ValueError):
        raise ClusterSpecError(
            name, raw, "is not a signal of this system", hint=f"name one, e.g. {STACK_SIGNAL} (the default) or SIGWINCH"
        ) from None
    if sig.name in _NOT_FOR_STACKS:
        raise ClusterSpecError(
            name,
            raw,
            f"{sig.name} cannot carry a stack dump (it stops, ends or crashes a process, or phalanx uses it)",
            hint=f"use a signal that is free in your programs, e.g. {STACK_SIGNAL} (the default) or SIGWINCH",
        )
    return sig.name


def _flag(name: str, raw: str, hint: str = "") -> bool:
    if raw not in ("0", "1"):
        raise ClusterSpecError(name, raw, "must be 0 or 1", hint=hint or None)
    return raw == "1"


@dataclass(frozen=True)
class Settings:
    """phalanx's settings; each field names its environment variable in ``metadata``.

    Attributes:
        collective_timeout: PHALANX_COLLECTIVE_TIMEOUT, seconds for one collective.
        rendezvous_timeout: PHALANX_RENDEZVOUS_TIMEOUT, seconds for the job to assemble.
        rendezvous_notice: PHALANX_RENDEZVOUS_NOTICE, seconds a task waits at rendezvous before it
            says, once on stderr, which tasks it is still waiting for (silence looks like a hang).
        rpc_timeout: PHALANX_RPC_TIMEOUT, seconds for one parameter-server call.
        orphan_timeout: PHALANX_ORPHAN_TIMEOUT, seconds a server waits for its coordinator.
        worker_recovery_timeout: PHALANX_WORKER_RECOVERY_TIMEOUT, seconds without any worker.
        central_copy: PHALANX_CENTRAL_COPY=1 forces CentralStorageStrategy's copy mode (tests).
        single_replica_collectives: PHALANX_SINGLE_REPLICA_COLLECTIVES=1 makes a one-replica
            synchronous strategy build its process group anyway (NCCL on a GPU), as DDP does at world
            size 1, so that one GPU runs the real collective path (tests, benchmarks).
        shm: PHALANX_SHM=0 turns the shared-memory all-reduce off.
        shm_packing: PHALANX_SHM_PACKING=0 keeps a host's replicas on their own cores when the host
            is crowded (by default they move onto one core then; see ``phalanx.comm.core_packing``).
        host_id: PHALANX_HOST_ID, what makes processes "the same host" (default: the hostname).
        bind_address: PHALANX_BIND_ADDRESS, overrides the host a parameter-server task listens on.
        cluster_secret: PHALANX_CLUSTER_SECRET (never shown in ``repr``).
        log_root: PHALANX_LOG_ROOT, where run directories (replicas' log files) go.
        keep_runs: PHALANX_KEEP_RUNS, run directories kept under the log root (older ones deleted).
        exit_timeout: PHALANX_EXIT_TIMEOUT, seconds the other replicas get once replica 0 finished.
        stop_grace: PHALANX_STOP_GRACE, seconds a replica gets between SIGTERM/SIGINT and SIGKILL.
        preemption_grace: PHALANX_PREEMPTION_GRACE, seconds replicas get to save after SIGTERM.
        restart_count: PHALANX_RESTART_COUNT, set by the launcher on a restarted job.
        checkpoint_fault: PHALANX_CHECKPOINT_FAULT, fault injection for checkpoint tests.
        clock_skew: PHALANX_CLOCK_SKEW, seconds a signed frame's time may differ from the receiver's.
        tls_cert, tls_key, tls_ca: PHALANX_TLS_CERT / _KEY / _CA, TLS between parameter-server tasks.
        interactive_start: PHALANX_INTERACTIVE_START, how a notebook starts its replicas: ``fork``
            or ``spawn`` (default: fork, spawn once CUDA is initialised); see ``phalanx.interactive``.
        fingerprint_every: PHALANX_FINGERPRINT_EVERY, steps between two fingerprints of the
            synchronised parameters by the consistency guard (0: only at the first step and after
            a restore), so a replica that trains differently is named within that many steps.
        guard_every: PHALANX_GUARD_EVERY, backward passes between two checks of the consistency
            guard's fields (0, the default: every pass on a CPU, every ``GUARD_EVERY_GPU`` on a GPU).
        debug: PHALANX_DEBUG=1 shows phalanx's own frames in the traceback of an uncaught
            configuration error (a TF_CONFIG typo, a malformed setting), which otherwise shows the
            program's frames and the error's line (``phalanx run --debug`` sets it for its job).
        start_method: PHALANX_START_METHOD, how ``phalanx run`` starts its replicas: ``fork``
            (from a server that imported torch once; the default on Linux) or ``spawn`` (each a
            fresh interpreter); see :mod:`phalanx.launch.forkserver`.
        job_report: PHALANX_JOB_REPORT=0 turns off the job report a job that watched itself (a
            summary writer, a progress bar, a profile) prints at exit (:mod:`phalanx.report`).
        flight_recorder: PHALANX_FLIGHT_RECORDER, how many of its last collectives each replica's
            flight recorder keeps (rounded up to a power of two, at least 8), for the diagnosis of
            a hang (:mod:`phalanx.comm.diagnosis`).
        min_nproc: PHALANX_MIN_NPROC, the fewest replicas an elastic synchronous job goes on with
            after losing some (``phalanx run --min-nproc``; 0, the default: any loss ends the job).
            See :mod:`phalanx.comm.elastic`.
        join_as: PHALANX_JOIN_AS, set by ``phalanx run --min-nproc`` for a replacement replica: its
            id in the elastic group it joins at a step boundary (-1, the default: not a replacement).
        launcher_store: PHALANX_LAUNCHER_STORE=1 (set by ``phalanx run --min-nproc``): the launcher
            serves the job's store at the master address, and every replica connects to it.
        stack_signal: PHALANX_STACK_SIGNAL, the signal on which a launched replica writes every
            thread's Python stack to its log (``kill -USR2 <pid>``; default SIGUSR2, leaving SIGUSR1
            to the program: Slurm's warning before a job's time runs out). The supervisor and the
            test harness send the same.
    """

    collective_timeout: float = field(default=COLLECTIVE_TIMEOUT, metadata={"env": "PHALANX_COLLECTIVE_TIMEOUT"})
    rendezvous_timeout: float = field(default=RENDEZVOUS_TIMEOUT, metadata={"env": "PHALANX_RENDEZVOUS_TIMEOUT"})
    rendezvous_notice: float = field(default=RENDEZVOUS_NOTICE, metadata={"env": "PHALANX_RENDEZVOUS_NOTICE"})
    rpc_timeout: float = field(default=RPC_TIMEOUT, metadata={"env": "PHALANX_RPC_TIMEOUT"})
    orphan_timeout: float = field(default=ORPHAN_TIMEOUT, metadata={"env": "PHALANX_ORPHAN_TIMEOUT"})
    worker_recovery_timeout: float = field(
        default=WORKER_RECOVERY_TIMEOUT, metadata={"env": "PHALANX_WORKER_RECOVERY_TIMEOUT"}
    )
    central_copy: bool = field(default=False, metadata={"env": "PHALANX_CENTRAL_COPY"})
    single_replica_collectives: bool = field(default=False, metadata={"env": "PHALANX_SINGLE_REPLICA_COLLECTIVES"})
    shm: bool = field(default=True, metadata={"env": "PHALANX_SHM"})
    shm_packing: bool = field(default=True, metadata={"env": "PHALANX_SHM_PACKING"})
    host_id: str | None = field(default=None, metadata={"env": "PHALANX_HOST_ID"})
    bind_address: str | None = field(default=None, metadata={"env": "PHALANX_BIND_ADDRESS"})
    cluster_secret: str | None = field(default=None, repr=False, metadata={"env": "PHALANX_CLUSTER_SECRET"})
    log_root: str | None = field(default=None, metadata={"env": "PHALANX_LOG_ROOT"})
    keep_runs: int = field(default=KEEP_RUNS, metadata={"env": "PHALANX_KEEP_RUNS"})
    exit_timeout: float = field(default=EXIT_TIMEOUT, metadata={"env": "PHALANX_EXIT_TIMEOUT"})
    stop_grace: float = field(default=STOP_GRACE, metadata={"env": "PHALANX_STOP_GRACE"})
    preemption_grace: float = field(default=PREEMPTION_GRACE, metadata={"env": "PHALANX_PREEMPTION_GRACE"})
    restart_count: int = field(default=0, metadata={"env": "PHALANX_RESTART_COUNT"})
    checkpoint_fault: str | None = field(default=None, metadata={"env": "PHALANX_CHECKPOINT_FAULT"})
    clock_skew: float = field(default=CLOCK_SKEW, metadata={"env": "PHALANX_CLOCK_SKEW"})
    tls_cert: str | None = field(default=None, metadata={"env": "PHALANX_TLS_CERT"})
    tls_key: str | None = field(default=None, metadata={"env": "PHALANX_TLS_KEY"})
    tls_ca: str | None = field(default=None, metadata={"env": "PHALANX_TLS_CA"})
    interactive_start: str | None = field(default=None, metadata={"env": "PHALANX_INTERACTIVE_START"})
    start_method: str | None = field(default=None, metadata={"env": "PHALANX_START_METHOD"})
    fingerprint_every: int = field(default=FINGERPRINT_EVERY, metadata={"env": "PHALANX_FINGERPRINT_EVERY"})
    guard_every: int = field(default=0, metadata={"env": "PHALANX_GUARD_EVERY"})
    job_report: str | None = field(default=None, metadata={"env": "PHALANX_JOB_REPORT"})
    debug: bool = field(default=False, metadata={"env": "PHALANX_DEBUG"})
    stack_signal: str = field(default=STACK_SIGNAL, metadata={"env": "PHALANX_STACK_SIGNAL"})
    flight_recorder: int = field(default=FLIGHT_RECORDER, metadata={"env": "PHALANX_FLIGHT_RECORDER"})
    min_nproc: int = field(default=0, metadata={"env": "PHALANX_MIN_NPROC"})
    launcher_store: bool = field(default=False, metadata={"env": "PHALANX_LAUNCHER_STORE"})
    join_as: int = field(default=-1, metadata={"env": "PHALANX_JOIN_AS"})

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """The settings in ``environ`` (default: ``os.environ``).

        Raises:
            ClusterSpecError: a variable is set to a malformed value (named, with the value).
        """
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            name = f.metadata["env"]
            raw = env.get(name)
            if raw is None or (raw == "" and f.type != "str | None"):
                continue
            if f.type == "float":
                values[f.name] = _seconds(name, raw)
            elif f.name == "central_copy":
                values[f.name] = _flag(
                    name, raw, "1 forces CentralStorageStrategy's copy mode on CPU replicas (for tests)"
                )
            elif f.name == "single_replica_collectives":
                values[f.name] = _flag(name, raw, "1 builds the process group of a one-replica job (tests, benchmarks)")
            elif f.name == "shm":
                values[f.name] = raw != "0"
            elif f.name == "debug":
                values[f.name] = _flag(name, raw, "1 shows phalanx's own frames in a configuration error's traceback")
            elif f.name == "launcher_store":
                values[f.name] = _flag(name, raw, "1 when the launcher serves the job's store (phalanx run sets it)")
            elif f.name == "shm_packing":
                values[f.name] = _flag(name, raw, "0 keeps a host's replicas on their own cores when it is crowded")
            elif f.name == "stack_signal":
                values[f.name] = _signal_name(name, raw)
            elif f.type == "int":
                if not raw.strip().isdigit():
                    raise ClusterSpecError(name, raw, "must be a non-negative integer")
                values[f.name] = int(raw)
            else:
                values[f.name] = raw
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Environment variable -> field name, for every setting."""
        return {f.metadata["env"]: f.name for f in fields(cls)}


def settings() -> Settings:
    """A snapshot of the settings in the environment now (take one when building a strategy)."""
    return Settings.from_environ()


def stack_signal(environ: Mapping[str, str] | None = None) -> signal.Signals:
    """The stack-dump signal (``PHALANX_STACK_SIGNAL``) in ``environ`` (default ``os.environ``).

    Example:
        >>> stack_signal({}).name
        'SIGUSR2'
    """
    return signal.Signals[Settings.from_environ(environ).stack_signal]
