"""What ran and how it ended: the task records, the root cause across them, and its report.

A :class:`Task` is what a supervisor starts, a :class:`Running` one it started, an :class:`Exit`
how one ended. :func:`root_cause` picks the first failure across tasks, after torch elastic's
``ChildFailedError``: a task that only lost a peer, or that the supervisor itself stopped, is never
the cause when another failure is there; when every failure is such a consequence, a task that a
peer's ``CollectiveTimeoutError`` waited for, alive until the supervisor stopped it, is the cause
(stalled). :func:`format_failure` says it in one format, with the error the process recorded
(torch elastic's error-file format, read here without torch) and the tail of its log. Kept apart
from the supervision loop (:mod:`phalanx.launch.supervisor`), as torch elastic keeps failures in
their own ``errors`` package.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from phalanx.launch.forkserver import ProcessHandle
from phalanx.launch.run_dir import tail

__all__ = [
    "Exit",
    "Running",
    "Task",
    "describe_exit_code",
    "diagnosed_cause",
    "exit_status",
    "format_failure",
    "is_consequence",
    "read_error",
    "root_cause",
    "who",
]

# Errors a task raises when it only saw a peer disappear: a consequence, never a root cause. (The
# PS client's errors are named here as text: the supervisor imports neither torch nor phalanx.ps.)
_CONSEQUENCES = (
    "PeerUnavailableError",
    "CollectiveTimeoutError",
    "ParameterServerUnavailableError",
    "TaskUnavailableError",
    "WorkerUnavailableError",
)


@dataclass(frozen=True, kw_only=True)
class Task:
    """One process of a job.

    Attributes:
        name: how reports name it ("replica 1", "worker:0").
        command: the full argv.
        env: variables added to the supervisor's own environment.
        log_path: where its stdout and stderr go; None: this process's terminal, untouched.
        error_path: where it records an uncaught exception (torch elastic's error-file format).
        done_path: where it marks that its program has finished (it is then only tearing down).
        info: extra identity for reports ("node 0, local rank 1").
        unset: variables of the supervisor's own environment the task does not inherit (a
            notebook kernel's own ``PHALANX_*`` identity is not its replicas').
    """

    name: str
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: str | None = None
    error_path: str | None = None
    done_path: str | None = None
    info: str = ""
    unset: tuple[str, ...] = ()


@dataclass
class Running:
    """A started task."""

    task: Task
    popen: subprocess.Popen | ProcessHandle  # a ForkedProcess, or a ChildProcess the supervisor forked
    started: float
    stopped_by_supervisor: bool = False
    failed_at: float | None = None  # when its error file appeared (it is failing, maybe still exiting)
    state_when_stopped: str = ""  # its state ("running", "stopped (SIGSTOP or a debugger)") when first signalled
    pump: threading.Thread | None = None  # the thread copying its output (tee), set by the supervisor

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def done(self) -> bool:
        """Whether its program has finished (its exit handlers ran); it may still be tearing down."""
        return bool(self.task.done_path) and os.path.exists(self.task.done_path)


@dataclass(frozen=True)
class Exit:
    """How a task ended."""

    task: Task
    pid: int
    code: int
    order: int  # 0 for the first task seen ending, 1 for the next, ...
    stopped_by_supervisor: bool = False
    message: str = ""  # the error the process recorded, if any
    timestamp: int = 0  # when (seconds since the epoch; from the error file when there is one)
    stopped_while_failing: bool = False  # it recorded its error; the supervisor ended its teardown
    # Set by root_cause() on a task the supervisor stopped while a peer's collective timed out
    # waiting for it (alive, not arriving): the error of the peer that waited.
    stalled: str = ""
    state_when_stopped: str = ""  # its process state when the supervisor first signalled it
    # Set by Supervisor.report_root_cause() on the replica a diagnosis (the replicas' flight
    # recorders, comm/diagnosis.py) names as the cause: what it says, in one line.
    diagnosed: str = ""

    @property
    def failed(self) -> bool:
        return self.code != 0

    @property
    def status(self) -> int:
        """The shell exit status this end stands for (1 for an error ended by the supervisor, a stall
        or a diagnosed cause)."""
        return 1 if self.stopped_while_failing or self.stalled or self.diagnosed else exit_status(self.code)

    @property
    def consequence(self) -> bool:
        """Whether this failure only followed another's (stopped by us, or lost a peer)."""
        # Stopped by us means killed by our signal: one that was already exiting with its own code
        # (a replica whose threads were still dying when a peer noticed) is not a consequence.
        return (self.stopped_by_supervisor and self.code < 0) or is_consequence(self.message)


def is_consequence(message: str) -> bool:
    """Whether a recorded error (``"PeerUnavailableError: ..."``) only says that a peer is gone."""
    return any(name in message for name in _CONSEQUENCES)


def describe_exit_code(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def read_error(path: str | None) -> tuple[str, int]:
    """The message and timestamp a task recorded in its error file (torch elastic's format,
    as ``ProcessFailure`` reads it; parsed here so that the supervisor need not import torch)."""
    now = int(time.time())
    if not path or not os.path.isfile(path):
        return "", now
    try:
        with open(path) as f:
            data = json.load(f)
        message = data["message"]
        if isinstance(message, str):
            return message, int(data.get("timestamp", now))
        return str(message.get("message", "")), int(message.get("extraInfo", {}).get("timestamp", now))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # never take the supervisor down
        return "", now


# In a CollectiveTimeoutError's message (errors.PeerUnavailableError's format): the peers it waited for.
_WAITED_FOR = re.compile(r"failed(?: at step \d+)?: (.+?) is unavailable \(")
_TASK_NAME = re.compile(r"\b([A-Za-z_]+)[: ](\d+)\b")


def _stalled_peers(message: str) -> set[str]:
    """The tasks a recorded ``CollectiveTimeoutError`` says it waited for, as ``"replica 1"`` and
    ``"replica:1"`` (the launchers' and the cluster spec's ways to name a task); empty for any
    other error. A timeout says the peer was alive (a dead one is a ``PeerUnavailableError``)."""
    if "CollectiveTimeoutError" not in message:
        return set()
    found = _WAITED_FOR.search(message.split("\n", 1)[0])
    if found is None:
        return set()
    names = set()
    for kind, index in _TASK_NAME.findall(found.group(1)):
        if kind != "rank":  # "replica:1 (rank 1)": the rank repeats the task
            names |= {f"{kind} {index}", f"{kind}:{index}"}
    return names


def root_cause(exits: Iterable[Exit]) -> Exit | None:
    """The first failure: not a consequence if any other is there, then the earliest.

    When every failure is a consequence, a task that a peer's collective timed out waiting for,
    and that was still running when the supervisor stopped it (stalled: stopped by SIGSTOP or a
    debugger, deadlocked, or busy far longer than its peers), is the cause, not the peer that
    waited; it is returned with :attr:`Exit.stalled` set.
    """
    exits = list(exits)
    failed = [e for e in exits if e.failed]
    if not failed:
        return None
    cause = min(failed, key=lambda e: (e.consequence, e.timestamp, e.order))
    if not cause.consequence:
        return cause
    for waiter in sorted(failed, key=lambda e: (e.timestamp, e.order)):
        waited_for = _stalled_peers(waiter.message)
        stalled = [
            e
            for e in failed
            if e is not waiter and e.stopped_by_supervisor and e.code < 0 and e.task.name in waited_for
        ]
        if stalled:
            error = waiter.message.strip().splitlines()[0] if waiter.message.strip() else "?"
            if waiter.task.log_path is None:  # it wrote to this terminal: its traceback is above
                error = f"{error.split(':', 1)[0]} (its traceback is above)"
            return dataclasses.replace(min(stalled, key=lambda e: e.order), stalled=f"{waiter.task.name}: {error}")
    return cause


# Errors that a failed collective raises on a replica that may not be the cause: the diagnosis decides.
_COLLECTIVE_ERRORS = (*_CONSEQUENCES, "CollectiveMismatchError", "ReplicaDivergenceError")


def diagnosed_cause(cause: Exit, exits: list[Exit], found: dict, runs: list[Running]) -> Exit:
    """The root cause a diagnosis names, where the failure found first only follows it."""
    culprits = found.get("culprits") or []
    if not culprits:
        return cause
    name = f"replica {culprits[0]}"
    where = next((e for e in found.get("replicas") or [] if e.get("rank") == culprits[0]), {})
    summary = str(found.get("summary") or where.get("where") or "")
    if cause.task.name == name:
        if cause.stalled:  # the stalled report; where it was, from its own answer
            if where.get("state") != "own code":
                return cause
            how = "busy, not stuck: " if where.get("busy") else ""
            return dataclasses.replace(cause, diagnosed=how + str(where.get("where")).split("; it never reached")[0])
        return cause if not cause.consequence else dataclasses.replace(cause, diagnosed=summary)
    if not any(kind in cause.message for kind in _COLLECTIVE_ERRORS) and not cause.stalled:
        return cause  # a failure of its own (an exception, a crash): the diagnosis only adds context
    culprit = next((e for e in exits if e.task.name == name), None)
    if culprit is not None and culprit.code == 0:
        return cause  # it finished its program: whoever still made collectives after it is the cause
    if culprit is None:  # still running (being stopped), or the launching process itself (self-launch)
        run = next((r for r in runs if r.task.name == name), None)
        task = run.task if run is not None else Task(name=name, command=(), info=f"rank {culprits[0]}")
        pid = run.pid if run is not None else int(where.get("pid") or 0)
        culprit = Exit(task, pid, 0, len(exits), True, "", int(time.time()))
    return dataclasses.replace(culprit, diagnosed=summary, stalled="")


def who(task: Task, pid: int) -> str:
    return f"{task.name} ({task.info + ', ' if task.info else ''}pid {pid})"


def format_failure(exit: Exit, *, lines: int = 15) -> str:
    """The report of one failed task: who, how, its recorded error and its log's last lines."""
    if exit.diagnosed and not exit.stalled:
        text = f"{who(exit.task, exit.pid)}: {exit.diagnosed}\n"
        if exit.failed and exit.task.log_path is not None:  # where it raised, from its log (if it did)
            log = tail(exit.task.log_path, 80)
            start = log.rfind("Traceback (most recent call last):")
            if start >= 0:
                text += f"last lines of {exit.task.log_path}:\n{log[start:]}\n"
        return text
    if exit.stalled:
        waiter, error = exit.stalled.split(": ", 1)
        state = exit.state_when_stopped or "running"
        why = "" if state != "running" else " (deadlocked, or busy far longer than its peers)"
        if exit.diagnosed:  # where it was, from its own answer: busy is not stuck
            return (
                f"{who(exit.task, exit.pid)} never arrived at a collective, and {waiter} timed out waiting for it. "
                f"It was {exit.diagnosed}, until the supervisor ended it ({describe_exit_code(exit.code)}).\n"
                f"{waiter}'s error: {error}\n"
            )
        return (
            f"{who(exit.task, exit.pid)} stalled: it was alive but never arrived at a collective, and "
            f"{waiter} timed out waiting for it. It was {state}{why} until the supervisor ended it "
            f"({describe_exit_code(exit.code)}).\n{waiter}'s error: {error}\n"
        )
    how = "an uncaught exception" if exit.stopped_while_failing else describe_exit_code(exit.code)
    text = f"{who(exit.task, exit.pid)} failed: {how}\n"
    log = tail(exit.task.log_path, 80)
    start = log.rfind("Traceback (most recent call last):")
    # The whole last traceback when there is one (it says where the replica was), else the tail.
    log = log[start:] if start >= 0 else "\n".join(log.splitlines()[-lines:])
    error = exit.message.strip().splitlines()[0] if exit.message.strip() else ""
    if error and exit.task.log_path is None:
        # It wrote to this terminal: its traceback is above, ending with the error. Name its type
        # only, so that the error itself is printed once.
        text += f"error: {error.split(':', 1)[0]} (its traceback is above)\n"
    elif error and error not in log:  # the log's traceback already ends with it: say it once
        text += f"error: {error}\n"
    if log:
        text += f"last lines of {exit.task.log_path}:\n{log}\n"
    elif exit.task.log_path is None and not exit.message:
        text += "(its output is above)\n"
    return text


def exit_status(code: int) -> int:
    """A shell exit status for a task's return code (128 + n for a signal)."""
    return 128 - code if code < 0 else code
