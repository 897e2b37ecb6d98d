"""The one supervisor under every launcher: start tasks, watch them, stop them, name the root cause.

Self-launch (``python train.py`` with a multi-replica strategy), ``phalanx run -n N``, the
parameter-server cluster (``phalanx run --ps P --workers W``) and notebook sessions
(:mod:`phalanx.interactive.session`: spawned replicas started here, forked ones adopted with
:meth:`Supervisor.adopt`) are configurations of this module, as torchrun and horovodrun are
configurations of their single cores. What they share:

* **Tasks.** A :class:`Task` is a name, a command, the environment it adds and where its output
  goes. A task with no ``log_path`` writes straight to this process's terminal (replica 0, the
  chief): its output is byte for byte what ``python train.py`` prints, Keras progress bars
  included. The others write to ``LOGDIR/<run-id>/<task>.log`` (:class:`RunDirectory`);
  ``tee=True`` also shows every task's lines on the terminal, prefixed with its name.
* **Die with the parent.** Every child gets ``PR_SET_PDEATHSIG`` (SIGKILL) from the kernel when
  the thread that started it ends, and a parent watch (:mod:`phalanx.launch.replica_hooks`) once
  it runs phalanx: ``kill -9`` of a launcher leaves no replica behind. A task forked from a fork
  server (``start_method="fork"``, :mod:`phalanx.launch.forkserver`) dies with the server, which
  dies with the supervisor.
* **Signals.** Children run in their own process group, so a Ctrl-C at the terminal reaches the
  supervisor alone, which forwards it once to every task (:meth:`Supervisor.stop`: the signal,
  a grace period, then SIGKILL).
* **One root-cause format** (:func:`root_cause`), after torch elastic's ``ChildFailedError``: the
  first failure across tasks, with the error its process recorded in torch elastic's error-file
  format (``TORCHELASTIC_ERROR_FILE``) and the tail of its log. A task that only lost a peer, or
  that the supervisor itself stopped, is never the cause when another failure is there; when the
  first failure seen is such a consequence, the supervisor waits (briefly, :data:`CAUSE_WAIT_S`)
  for the failure it followed before it stops anything or reports (:meth:`Supervisor.await_cause`).
  When no other failure comes, a task that a peer's ``CollectiveTimeoutError`` waited for, alive
  until the supervisor stopped it, is the cause: named as stalled, with its state then (stopped by
  SIGSTOP or a debugger, or running) and the error of the peer that waited.

Example::

    >>> import sys
    >>> sup = Supervisor()
    >>> run = sup.start(Task(name="hello", command=(sys.executable, "-c", "print('hi')"), log_path=None))
    >>> sup.wait(run, timeout=30)
    0
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from phalanx.comm import diagnosis
from phalanx.errors import LaunchError
from phalanx.launch import settings
from phalanx.launch.forkserver import (
    INHERIT_VARIABLE,
    ForkedProcess,
    ForkServer,
    ProcessHandle,
    die_with_parent,
    forkable,
    inherited_server,
    preload_for,
)

__all__ = [
    "Exit",
    "RunDirectory",
    "Running",
    "Supervisor",
    "Task",
    "describe_exit_code",
    "new_run_id",
    "prune_runs",
    "root_cause",
    "tail",
    "wait_for_the_rest",
]

_RUN_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")
_MARKER = ".supervisor"  # in a run directory: the pid of the supervisor that writes there
_OWNER = ".owner"  # in a run directory: whose it is (run_owner); only its owner's runs prune it
# Errors a task raises when it only saw a peer disappear: a consequence, never a root cause. (The
# PS client's errors are named here as text: the supervisor imports neither torch nor phalanx.ps.)
_CONSEQUENCES = (
    "PeerUnavailableError",
    "CollectiveTimeoutError",
    "ParameterServerUnavailableError",
    "TaskUnavailableError",
    "WorkerUnavailableError",
)

FAILING_GRACE_S = 0.5  # a task that recorded its error gets this long to finish exiting by itself
# A failure that is only a consequence waits at most this long for the one it followed to show: the
# peer that failed first is often still exiting (its teardown can take seconds), or its end not yet
# reported (a fork server reports an exit a moment after the process ended).
CAUSE_WAIT_S = 2.0
# A replica diagnosing a failed collective (its peers' answers, then diagnosis.json) gets this long
# before it is stopped; after a task was killed by a signal, its peers get DIAGNOSIS_SETTLE_S to start.
DIAGNOSIS_WAIT_S = 3.0
DIAGNOSIS_SETTLE_S = 0.3


# ----------------------------------------------------------------------------- run directories
def new_run_id() -> str:
    """A run id that sorts by start time: ``20260101-120000-1a2b3c``."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        return f"uid{os.getuid()}"


def run_owner(command: Sequence[str]) -> str:
    """Whose runs a run directory counts among: ``user@host program``.

    The program is a script's absolute path (``phalanx run``'s command has no interpreter, and may
    name it relatively; self-launch's starts with ``sys.executable``), ``-m module``, or the first
    words of another command (an R host's). The host tells apart machines that share a log root
    on a network file system.

    Example:
        >>> run_owner(["python3", "-m", "trainer.main", "--epochs", "3"]).endswith(" -m trainer.main")
        True
    """
    args = [str(a) for a in command]
    if len(args) > 1 and (args[0] == sys.executable or os.path.basename(args[0]).startswith("python")):
        args = args[1:]
    if not args:
        program = "?"
    elif args[0] in ("-m", "-c") and len(args) > 1:
        program = f"{args[0]} {args[1]}" if args[0] == "-m" else "-c"
    elif args[0].startswith("-"):
        program = " ".join(args[:3])
    else:
        program = os.path.abspath(args[0])
    return f"{_user()}@{socket.gethostname()} {program}"


def prune_runs(root: str, keep: int, *, current: str | None = None, owner: str | None = None) -> list[str]:
    """Deletes the oldest run directories under ``root`` so that ``keep`` remain; returns them.

    Only directories named like a run id are touched, never one whose supervisor still runs. With
    ``owner`` (:func:`run_owner`), only that owner's runs count and are deleted: another program's,
    another user's or host's, and a run that names no owner are never touched.
    """
    try:
        names = sorted(n for n in os.listdir(root) if _RUN_ID.match(n) and os.path.isdir(os.path.join(root, n)))
    except OSError:
        return []
    if owner is not None:
        names = [n for n in names if n == current or _owner_of(os.path.join(root, n)) == owner]
    removed = []
    for name in names[: max(0, len(names) - keep)]:
        path = os.path.join(root, name)
        if name == current:
            continue
        try:
            with open(os.path.join(path, _MARKER)) as f:
                if _pid_alive(int(f.read().strip() or 0)):
                    continue
        except (OSError, ValueError):
            pass
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _owner_of(path: str) -> str | None:
    try:
        with open(os.path.join(path, _OWNER)) as f:
            return f.read()
    except OSError:
        return None


class RunDirectory:
    """``LOGDIR/<run-id>/``: one run's logs (``<task>.log``) and error files (``<task>.error.json``).

    Args:
        root: the log root; default :func:`phalanx.launch.settings.log_root`.
        run_id: default a fresh :func:`new_run_id`.
        program: the command the run runs, whose owner (:func:`run_owner`) the run is written as;
            the runs kept are counted per owner.
    """

    def __init__(self, root: str | None = None, run_id: str | None = None, *, program: Sequence[str] = ()) -> None:
        self.root = os.path.abspath(root or settings.log_root())
        self.run_id = run_id or new_run_id()
        self.path = os.path.join(self.root, self.run_id)
        self.owner = run_owner(program)

    def create(self) -> RunDirectory:
        """Creates the directory and prunes its owner's oldest ones (``PHALANX_KEEP_RUNS`` are kept
        per user, host and program: another job's never count, and are never deleted)."""
        keep = settings.keep_runs()
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, _MARKER), "w") as f:
            f.write(str(os.getpid()))
        with open(os.path.join(self.path, _OWNER), "w") as f:
            f.write(self.owner)
        prune_runs(self.root, keep, current=self.run_id, owner=self.owner)
        return self

    def log_path(self, stem: str) -> str:
        return os.path.join(self.path, f"{stem}.log")

    def error_path(self, stem: str) -> str:
        return os.path.join(self.path, f"{stem}.error.json")

    def done_path(self, stem: str) -> str:
        return os.path.join(self.path, f".{stem}.done")


def tail(path: str | None, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read()
    except OSError:
        return ""
    # A progress bar rewrites its line with carriage returns: keep what the line showed last.
    text = [line.rsplit(b"\r", 1)[-1] if line.rstrip(b"\r") else line for line in data.splitlines()]
    return b"\n".join(text[-lines:]).decode(errors="replace")


# ----------------------------------------------------------------------------- tasks
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
    popen: subprocess.Popen | ForkedProcess | ChildProcess
    started: float
    stopped_by_supervisor: bool = False
    failed_at: float | None = None  # when its error file appeared (it is failing, maybe still exiting)
    state_when_stopped: str = ""  # its state ("running", "stopped (SIGSTOP or a debugger)") when first signalled
    _pump: threading.Thread | None = None

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
        return (self.stopped_by_supervisor and self.code < 0) or _is_consequence(self.message)


def _is_consequence(message: str) -> bool:
    """Whether a recorded error (``"PeerUnavailableError: ..."``) only says that a peer is gone."""
    return any(name in message for name in _CONSEQUENCES)


def describe_exit_code(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _read_error(path: str | None) -> tuple[str, int]:
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


def _diagnosed_cause(cause: Exit, exits: list[Exit], found: dict, runs: list[Running]) -> Exit:
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


def _who(task: Task, pid: int) -> str:
    return f"{task.name} ({task.info + ', ' if task.info else ''}pid {pid})"


def format_failure(exit: Exit, *, lines: int = 15) -> str:
    """The report of one failed task: who, how, its recorded error and its log's last lines."""
    if exit.diagnosed and not exit.stalled:
        text = f"{_who(exit.task, exit.pid)}: {exit.diagnosed}\n"
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
                f"{_who(exit.task, exit.pid)} never arrived at a collective, and {waiter} timed out waiting for it. "
                f"It was {exit.diagnosed}, until the supervisor ended it ({describe_exit_code(exit.code)}).\n"
                f"{waiter}'s error: {error}\n"
            )
        return (
            f"{_who(exit.task, exit.pid)} stalled: it was alive but never arrived at a collective, and "
            f"{waiter} timed out waiting for it. It was {state}{why} until the supervisor ended it "
            f"({describe_exit_code(exit.code)}).\n{waiter}'s error: {error}\n"
        )
    how = "an uncaught exception" if exit.stopped_while_failing else describe_exit_code(exit.code)
    text = f"{_who(exit.task, exit.pid)} failed: {how}\n"
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


# ----------------------------------------------------------------------------- the supervisor
class ChildProcess(ProcessHandle):
    """A child this process forked itself: the part of :class:`subprocess.Popen` a supervisor uses.

    Reaped once, under a lock: the supervisor's watcher and the program's main thread may both
    poll, and the second to ask would otherwise see "no such child" and lose the status.

    Attributes:
        pid: its process id.
        returncode: its exit code once it has ended (``-N`` when killed by signal N), else None;
            -1 if something else in this process reaped it first.
    """

    stdout = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its status is lost
                    self.returncode = -1
                else:
                    if pid != 0:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def _pause(self, seconds: float) -> None:
        time.sleep(min(seconds, 0.01))  # no one reports its end: poll often


def _child_setup(parent: int) -> None:  # runs in the child between fork and exec
    # Its own process group: a Ctrl-C at the terminal reaches the supervisor, which forwards it once.
    die_with_parent(parent, own_group=True)


class Supervisor:
    """Starts tasks, watches them and stops them; the three launchers are configurations of it.

    Args:
        tee: also show every logged task's lines on this process's stdout, prefixed ``[name]``.
        out: where the supervisor's own messages go (default stderr).
        start_method: ``spawn`` (each task a fresh ``exec``) or ``fork`` (Python tasks forked from
            a server that imported torch once: :mod:`phalanx.launch.forkserver`; a task that
            cannot be forked is spawned).
        preload: with ``fork``, modules for the server to import besides those
            :func:`~phalanx.launch.forkserver.preload_for` finds in the script.
        run_dir: the tasks' run directory, where a replica whose collective failed writes its
            diagnosis (:mod:`phalanx.comm.diagnosis`); the root-cause report prints it.
    """

    def __init__(
        self,
        *,
        tee: bool = False,
        out: IO[str] | None = None,
        start_method: str = "spawn",
        preload: Sequence[str] = (),
        run_dir: str | None = None,
    ) -> None:
        if start_method not in ("spawn", "fork"):
            raise ValueError(f"start_method must be 'spawn' or 'fork', not {start_method!r}")
        self.tee = tee
        self.start_method = start_method
        self.preload = tuple(preload)
        self._fork_server: ForkServer | None = None
        self._out = out
        self._runs: list[Running] = []
        self._exits: list[Exit] = []
        self._cause_reported = False  # this attempt printed a root cause: it failed (job_status)
        # Where the tasks' run directory is (their logs, and a diagnosis a replica wrote there).
        self.run_dir = run_dir
        self._attempt_started = time.time()
        self._lock = threading.Lock()
        self._tee_lock = threading.Lock()

    # ------------------------------------------------------------------ messages
    def say(self, text: str) -> None:
        """Prints a supervisor message (prefixed ``phalanx:``)."""
        out = self._out or sys.stderr
        with contextlib.suppress(Exception):
            out.write(f"phalanx: {text.rstrip()}\n")
            out.flush()

    # ------------------------------------------------------------------ starting
    def start(self, task: Task) -> Running:
        """Starts ``task`` (again, for a restart) and returns its handle."""
        inherited = {k: v for k, v in os.environ.items() if k not in task.unset}
        env = {**inherited, **task.env, "PHALANX_PARENT_PID": str(os.getpid())}  # see env.SUPERVISOR_VARIABLES
        env.pop(INHERIT_VARIABLE, None)  # this process's connection, not the task's
        if task.error_path:
            with contextlib.suppress(OSError):
                os.unlink(task.error_path)
            env["TORCHELASTIC_ERROR_FILE"] = task.error_path
        if task.done_path:
            with contextlib.suppress(OSError):
                os.unlink(task.done_path)
            env["PHALANX_DONE_FILE"] = task.done_path
        if self.run_dir:  # this supervisor prints the diagnosis a replica writes there: it need not
            env["PHALANX_DIAGNOSIS_DIR"] = self.run_dir
        piped = task.log_path is not None and self.tee
        log = None
        if task.log_path is not None:
            env["PYTHONUNBUFFERED"] = "1"  # a log read while the job runs (or after a kill) is complete
            log = open(task.log_path, "ab")  # noqa: SIM115 - the child owns it from here
        stdout = subprocess.PIPE if piped else log
        stderr = subprocess.STDOUT if log is not None else None
        try:
            server = self._server_for(task, env)
            popen: subprocess.Popen | ForkedProcess
            if server is not None:
                env["PHALANX_PARENT_PID"] = str(server.pid)  # its parent, which it watches
                popen = server.spawn(
                    task.command,
                    env=env,
                    stdout=subprocess.PIPE if piped else (log.fileno() if log is not None else None),
                    stderr=stderr,
                )
            else:
                popen = subprocess.Popen(
                    list(task.command),
                    env=env,
                    stdout=stdout,
                    stderr=stderr,
                    stdin=subprocess.DEVNULL,
                    # Not thread-safe in general (PLW1509); this one calls only
                    # async-signal-safe functions, resolved before the fork.
                    preexec_fn=functools.partial(_child_setup, os.getpid()),
                )  # noqa: PLW1509
        except BaseException:
            if log is not None:
                log.close()
            raise
        run = Running(task, popen, time.monotonic())
        if piped:
            run._pump = threading.Thread(
                target=self._pump, args=(popen.stdout, log, task.name), name=f"phalanx-tee-{task.name}", daemon=True
            )
            run._pump.start()
        elif log is not None:
            log.close()
        with self._lock:
            self._runs = [r for r in self._runs if r.task.name != task.name] + [run]
        return run

    def adopt(self, task: Task, pid: int) -> Running:
        """Watches ``pid``, a child this process forked itself, as one of its tasks.

        For a replica that must go on from this process's own state (a notebook kernel's, forked
        mid-program), which no command can start: from here the supervisor reaps, signals and
        reports it like the tasks it started (``task.command`` is empty).
        """
        run = Running(task, ChildProcess(pid), time.monotonic())
        with self._lock:
            self._runs = [r for r in self._runs if r.task.name != task.name] + [run]
        return run

    def _server_for(self, task: Task, env: Mapping[str, str]) -> ForkServer | None:
        """The fork server to start ``task`` from, or None to spawn it (see ``start_method``)."""
        if self.start_method != "fork":
            return None
        if self._fork_server is None or not self._fork_server.alive:  # first, or killed by someone
            preload = preload_for(task.command, extra=self.preload)
            self._fork_server = inherited_server()
            if self._fork_server is not None and not set(preload) <= set(self._fork_server.preload):
                self._fork_server.close()  # it lacks what these tasks import: one server that has it
                self._fork_server = None
            if self._fork_server is None:
                self._fork_server = ForkServer(preload, env=os.environ)
        why = forkable(task.command, env, self._fork_server.env)
        if why is not None:
            self.say(f"{task.name} starts a fresh interpreter ({why})")
            return None
        try:
            self._fork_server.start()
        except LaunchError as e:  # a job never fails for want of its fork server: start fresh
            self.say(f"{e}; replicas start fresh from here on")
            self.start_method = "spawn"
            return None
        return self._fork_server

    def close(self) -> None:
        """Ends the fork server, if one was started (call once every task has ended)."""
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = None

    def _pump(self, pipe: IO[bytes], log: IO[bytes] | None, name: str) -> None:
        """``--tee``: copies a task's output to its log, and line by line, prefixed, to stdout.

        The task's pipe is read to its end whatever happens to stdout: a reader that went away
        (``| head -1``) ends the copy to stdout only, never the task (which would get
        ``BrokenPipeError`` from a closed pipe, or block on a full one) nor its log.
        """
        prefix, partial = f"[{name}] ".encode(), b""
        out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None

        def show(data: bytes) -> None:
            nonlocal out
            if out is None:
                return
            with self._tee_lock:
                try:
                    out.write(data)
                    out.flush()
                except (OSError, ValueError):
                    out = None  # stdout is gone: the log alone from here

        try:
            while True:
                chunk = os.read(pipe.fileno(), 65536)
                if not chunk:
                    break
                if log is not None:
                    log.write(chunk)
                    log.flush()
                *lines, partial = (partial + chunk).split(b"\n")
                if lines:
                    show(b"".join(prefix + line + b"\n" for line in lines))
            if partial:
                show(prefix + partial + b"\n")
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()
            if log is not None:
                log.close()

    # ------------------------------------------------------------------ watching
    @property
    def runs(self) -> list[Running]:
        with self._lock:
            return list(self._runs)

    def alive(self) -> list[Running]:
        return [r for r in self.runs if r.popen.poll() is None]

    def failing(self) -> list[Running]:
        """Tasks that recorded an uncaught exception and have not exited yet (see :meth:`poll`)."""
        return [r for r in self.alive() if r.failed_at is not None]

    def poll(self) -> list[Exit]:
        """The tasks that ended since the last call, in the order they were seen ending."""
        ended = []
        with self._lock:
            runs = list(self._runs)
        for run in runs:
            code = run.popen.poll()
            if code is None:
                # A replica records its uncaught exception before it tears down (which can take
                # seconds): that is when it fails, for the purpose of stopping the job.
                _note_recorded_error(run)
                continue
            if run._pump is not None:
                run._pump.join(timeout=2)
            message, timestamp = _read_error(run.task.error_path) if code != 0 else ("", int(time.time()))
            if run.failed_at is not None and code == 0:
                code = 1  # it recorded an error, then exited 0 (sys.exit(0) in a finally, say)
            with self._lock:
                if run not in self._runs:
                    continue
                self._runs.remove(run)
                exit = Exit(
                    run.task,
                    run.pid,
                    code,
                    len(self._exits),
                    run.stopped_by_supervisor,
                    message,
                    timestamp,
                    run.failed_at is not None and code < 0,
                    state_when_stopped=run.state_when_stopped,
                )
                self._exits.append(exit)
            ended.append(exit)
        return ended

    def record(self, task: Task, pid: int, code: int, message: str) -> Exit:
        """Counts the end of a process that this supervisor does not run among the job's exits.

        Self-launch's replica 0 is the launching process itself: its own failure takes part in
        :meth:`await_cause` and in the root cause like any task's.
        """
        with self._lock:
            exit = Exit(task, pid, code, len(self._exits), False, message, int(time.time()))
            self._exits.append(exit)
        return exit

    def cause_known(self) -> bool:
        """Whether a failure that is not a consequence has been seen, or can no longer come.

        That is: an exit that is not a consequence; a task still exiting that recorded an error
        that is not one; or no task left running.
        """
        if any(e.failed and not e.consequence for e in self.exits):
            return True
        alive = self.alive()
        return not alive or any(
            r.failed_at is not None and not _is_consequence(_read_error(r.task.error_path)[0]) for r in alive
        )

    def await_cause(self, timeout: float = CAUSE_WAIT_S) -> list[Exit]:
        """After a failure: waits, at most ``timeout`` seconds, until :meth:`cause_known`.

        A task that only lost a peer fails at once, while the peer whose error it follows may still
        be exiting; stopping the job then would kill that peer before it records its error (and
        count it as stopped by us), and a report would name the consequence. Returns at once when
        the cause is known; never waits more than ``timeout``.

        Returns:
            The exits seen meanwhile.
        """
        deadline = time.monotonic() + timeout
        seen: list[Exit] = []
        while True:
            seen += self.poll()
            if self.cause_known() or time.monotonic() >= deadline:
                return seen
            time.sleep(0.02)

    def await_diagnosis(self, limit: float = DIAGNOSIS_WAIT_S, settle: float = DIAGNOSIS_SETTLE_S) -> list[Exit]:
        """Before the others are stopped: lets a replica that is diagnosing the failure finish.

        A replica whose collective failed asks every replica where it is, then writes the diagnosis
        to the run directory (:mod:`phalanx.comm.diagnosis`); meanwhile a marker says so. Stopping it
        then would lose the diagnosis. Waits while a marker is there, at most ``limit`` seconds;
        after a task killed by a signal (a crash, the OOM killer: its peers notice within a tenth of
        a second, and their view of where they were is all there is) first ``settle`` seconds for
        one to start. Returns at once where no run directory is kept.

        Returns:
            The exits seen meanwhile.
        """
        if not self.run_dir:
            return []
        seen: list[Exit] = []
        start = time.monotonic()
        killed = any(e.code < 0 and not e.stopped_by_supervisor for e in self.exits)
        while self.alive() and time.monotonic() - start < limit:
            if not diagnosis.pending(self.run_dir) and (not killed or time.monotonic() - start >= settle):
                break
            time.sleep(0.02)
            seen += self.poll()
        return seen

    def forget_exits(self) -> None:
        """Starts a new attempt: earlier ends (and an earlier diagnosis) no longer count for the root cause."""
        with self._lock:
            self._exits = []
            self._cause_reported = False
            self._attempt_started = time.time()

    @property
    def exits(self) -> list[Exit]:
        """Every task end seen so far."""
        with self._lock:
            return list(self._exits)

    def wait(self, run: Running, timeout: float | None = None) -> int | None:
        """Waits for one task; its exit code, or None if it still runs after ``timeout``."""
        try:
            return run.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_any(self, runs: Sequence[Running], timeout: float, period: float = 0.05) -> bool:
        """Waits until every one of ``runs`` has ended (True) or ``timeout`` passed (False)."""
        deadline = time.monotonic() + timeout
        while any(r.popen.poll() is None for r in runs):
            if time.monotonic() >= deadline:
                return False
            time.sleep(period)
        return True

    # ------------------------------------------------------------------ stopping
    def signal_all(self, sig: int, runs: Sequence[Running] | None = None) -> None:
        """Sends ``sig`` to every running task (each in its own process group)."""
        for run in runs if runs is not None else self.alive():
            _note_stopped(run)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(run.pid, sig)

    def stop(
        self,
        sig: int = signal.SIGTERM,
        grace: float | None = None,
        *,
        runs: Sequence[Running] | None = None,
        end_teardown: bool = False,
    ) -> None:
        """Signal forwarding: ``sig`` to every task, ``grace`` seconds, then SIGKILL to what is left.

        Args:
            end_teardown: SIGKILL a task as soon as its program has finished (:attr:`Running.done`)
                rather than wait for its interpreter's teardown (a final collection over torch's
                objects: about a second, more under load). Only where the tasks' exit codes
                decide nothing (an interrupt); never for a preemption, whose exit 42 asks for a
                restart.
        """
        runs = [r for r in (runs if runs is not None else self.alive()) if r.popen.poll() is None]
        if not runs:
            return
        grace = settings.stop_grace() if grace is None else grace
        self.signal_all(sig, runs)
        deadline = time.monotonic() + grace
        try:
            while True:
                left = [r for r in runs if r.popen.poll() is None]
                if not left or time.monotonic() >= deadline:
                    break
                finished = [r for r in left if r.done] if end_teardown else []
                if finished:
                    self.kill(finished)
                time.sleep(0.02)
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            pass
        self.kill([r for r in runs if r.popen.poll() is None])

    def stop_after_failure(self, grace: float | None = None) -> list[Exit]:
        """A task failed: SIGTERM to the others at once, SIGKILL to what is left after ``grace``
        seconds. A failing task (its error recorded, its traceback in its log) gets
        :data:`FAILING_GRACE_S` to end its own teardown. When every failure seen is only a
        consequence (a lost peer), the one it followed first gets up to :data:`CAUSE_WAIT_S` to
        show (:meth:`await_cause`). Returns the exits seen meanwhile."""
        grace = settings.stop_grace() if grace is None else grace
        seen = self.await_cause()
        seen += self.await_diagnosis()
        failing = self.failing()
        others = [r for r in self.alive() if r not in failing]
        self.signal_all(signal.SIGTERM, others)
        try:
            self.wait_any(self.alive(), min(grace, FAILING_GRACE_S))
            self.kill(failing)
            self.wait_any(self.alive(), max(0.0, grace - FAILING_GRACE_S))
        finally:
            self.kill()
        return seen + self.poll()

    def end_failing(self) -> list[Exit]:
        """Tasks that recorded an error and are still exiting get :data:`FAILING_GRACE_S` to end,
        then are killed (they count as failed by themselves). Returns the exits seen meanwhile."""
        failing = self.failing()
        if failing:
            self.wait_any(failing, FAILING_GRACE_S)
            self.kill(failing)
        return self.poll()

    def kill(self, runs: Sequence[Running] | None = None) -> None:
        for run in runs if runs is not None else self.alive():
            _note_stopped(run)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                run.popen.kill()
        for run in runs if runs is not None else self.runs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.popen.wait(timeout=5)

    def dump_stacks(self, runs: Sequence[Running], settle: float = 1.0) -> dict[str, str]:
        """Asks each task for its Python stack; returns what each wrote (or why there is none).

        A replica registers :mod:`faulthandler` on the stack-dump signal (``PHALANX_STACK_SIGNAL``,
        default SIGUSR2; :mod:`phalanx.launch.replica_hooks`), which writes every thread's stack to
        its log; py-spy is used where it is installed and the task has no such handler. A task
        without either is not signalled (the signal's default action would kill it).
        """
        sizes, stacks = {}, {}
        signalled = []
        sig = settings.stack_signal()
        for run in runs:
            path = run.task.log_path
            sizes[run.task.name] = os.path.getsize(path) if path and os.path.exists(path) else 0
            if _catches(run.pid, sig):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.pid, sig)
                signalled.append(run)
            elif shutil.which("py-spy"):
                try:
                    stacks[run.task.name] = subprocess.run(
                        ["py-spy", "dump", "--pid", str(run.pid)],
                        check=False,
                        capture_output=True,
                        text=True,
                        timeout=10,
                    ).stdout
                except (OSError, subprocess.SubprocessError) as e:
                    stacks[run.task.name] = f"(py-spy failed: {e})"
            else:
                stacks[run.task.name] = (
                    f"(no stack: it has no {sig.name} stack-dump handler (PHALANX_STACK_SIGNAL) "
                    "and py-spy is not installed)"
                )
        if signalled:
            time.sleep(settle)
        for run in signalled:
            path = run.task.log_path
            if path is None:
                stacks[run.task.name] = "(its stack is above)"
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(sizes[run.task.name])
                    stacks[run.task.name] = f.read().decode(errors="replace").strip() or "(no stack written)"
            except OSError:
                stacks[run.task.name] = "(no log)"
        return stacks

    # ------------------------------------------------------------------ reporting
    def diagnosis(self) -> dict | None:
        """The diagnosis a replica of this attempt wrote to the run directory, if any."""
        if not self.run_dir:
            return None
        return diagnosis.read(self.run_dir, since=self._attempt_started - 1.0)

    def report_root_cause(self, exits: Iterable[Exit] | None = None) -> Exit | None:
        """Prints the root-cause report once, in the one format; returns the failure it named.

        Where a replica wrote a diagnosis (its collective failed: it asked every replica where it
        was), the diagnosis names the cause when the failures seen only follow it (a timeout, a lost
        peer, collectives that do not match): the replica that never arrived, or that made another
        call, whatever its state, never the one that waited. The diagnosis is printed after the
        root cause, once.
        """
        exits = self.exits if exits is None else list(exits)
        cause = root_cause(exits)
        found = self.diagnosis() if cause is not None else None
        if cause is not None and found is not None:
            cause = _diagnosed_cause(cause, exits, found, self.runs)
        if cause is not None:
            self._cause_reported = True
            self.say("root cause (first failure): " + format_failure(cause))
            if found is not None:
                self.say(diagnosis.render(found, where=os.path.join(self.run_dir or "", diagnosis.FILE)))
        return cause

    def job_status(self, code: int) -> int:
        """The job's exit status for ``code``: never 0 once this attempt reported a root cause.

        Whatever path a job's end took, one that printed its root cause failed; a launcher passes
        its status through here last.
        """
        return 1 if code == 0 and self._cause_reported else code


class Interrupted(Exception):
    """The supervisor was told to stop (SIGTERM, SIGINT); ``signum`` says how."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def forwarded_signals() -> Iterator[None]:
    """Turns SIGTERM/SIGINT to this process into :class:`Interrupted` in the main thread's loop."""

    def on_signal(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def stop_on_signal(sup: Supervisor, signum: int) -> int:
    """Forwards ``signum`` to every task, waits its grace period, kills the rest; the exit status."""
    grace = settings.preemption_grace() if signum == signal.SIGTERM else settings.stop_grace()
    name = signal.Signals(signum).name
    sup.say(f"received {name}; passing it to {len(sup.alive())} task(s) (up to {grace:g} s before SIGKILL)")
    # Ignore further signals while stopping: a second one must not abandon children half-stopped.
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sup.stop(signum, grace)
    sup.poll()
    return 128 + signum


def lingering(runs: Sequence[Running]) -> list[Running]:
    """Of ``runs``, those still running their program (not merely tearing down after it finished)."""
    return [r for r in runs if not r.done]


def wait_for_the_rest(
    sup: Supervisor, *, primary: str = "replica 0", notice_after: float = 2.0, limit: float | None = None
) -> int:
    """After ``primary`` finished normally: the others get ``limit`` seconds (default
    ``PHALANX_EXIT_TIMEOUT``) to finish.

    One still running its program after that is a failure: it is named with its stack (the root
    cause), the rest are stopped, and the status is 1. The wait is announced after
    ``notice_after`` seconds, never silent. A failure meanwhile is reported as usual. A task that
    finished its program and is only tearing down is stopped without failing the job.

    Returns:
        0, or the exit status of the failure.
    """
    limit = settings.exit_timeout() if limit is None else limit
    start = time.monotonic()
    noticed = False
    while True:
        ended = sup.poll()
        if any(e.failed for e in ended) or sup.failing():
            sup.stop_after_failure()
            cause = sup.report_root_cause()
            return cause.status or 1 if cause is not None else 1
        alive = sup.alive()
        if not alive:
            return 0
        busy = lingering(alive)
        waited = time.monotonic() - start
        if busy and not noticed and waited >= notice_after:
            noticed = True
            sup.say(
                f"{primary} has finished; waiting up to {limit:g} s for "
                + ", ".join(f"{r.task.name} (pid {r.pid})" for r in busy)
                + " to finish"
            )
        if waited >= limit:
            if not busy:
                sup.say(
                    ", ".join(r.task.name for r in alive) + f" finished but still tore down {limit:g} s later; stopped"
                )
                sup.kill()
                sup.poll()
                return 0
            stacks = sup.dump_stacks(busy)
            first = busy[0]
            sup.say(
                f"root cause (first failure): {_who(first.task, first.pid)} was still running {limit:g} s after "
                f"{primary} finished normally (blocked in a collective that {primary} never joined, or "
                f"a program that does more on some replicas). Where it was:\n"
                + "\n".join(stacks.get(first.task.name, "").splitlines()[-40:])
            )
            sup._cause_reported = True
            if len(busy) > 1:
                sup.say("also still running: " + ", ".join(f"{r.task.name} (pid {r.pid})" for r in busy[1:]))
            sup.stop(signal.SIGTERM)
            sup.poll()
            return 1
        time.sleep(0.05)


def _note_recorded_error(run: Running) -> bool:
    """Whether ``run`` has recorded an uncaught exception (its error file exists); notes when first seen."""
    if run.failed_at is None and run.task.error_path and os.path.exists(run.task.error_path):
        run.failed_at = time.monotonic()
    return run.failed_at is not None


def _note_stopped(run: Running) -> None:
    """Notes, before the supervisor first signals ``run``, whether that stops it or it had failed by itself.

    One that had recorded its own error by then stays a failure, not a consequence of being
    stopped (its error file is looked for now, not at the last poll); an error it records after
    the signal (a KeyboardInterrupt, say) is the signal's.
    """
    if not run.stopped_by_supervisor:
        run.stopped_by_supervisor = not _note_recorded_error(run)
        if run.stopped_by_supervisor:
            run.state_when_stopped = _process_state(run.pid)


_STATES = {
    "T": "stopped (SIGSTOP or a debugger)",
    "t": "stopped by a debugger",
    "D": "in an uninterruptible wait (I/O)",
}


def _process_state(pid: int) -> str:
    """What ``pid`` was doing, from ``/proc/<pid>/stat`` ('' when unknown): says why a task stalled."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return _STATES.get(state, "running" if state in ("R", "S") else "")


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt in /proc/<pid>/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def exit_status(code: int) -> int:
    """A shell exit status for a task's return code (128 + n for a signal)."""
    return 128 - code if code < 0 else code
