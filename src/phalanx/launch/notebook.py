"""The notebook's launcher: starts, watches and stops the replicas of an interactive session.

A notebook, the REPL, ``python -c`` or stdin has no script to start again, so its replicas are
made from the interactive process itself (Lightning's ``ddp_notebook`` is a fork launcher too):

* **fork** (default): each child is a copy of the interactive process at the moment the strategy
  is constructed; :meth:`NotebookLauncher.fork` returns in the child what the session makes of it
  (its replica side), and the parent's :class:`~phalanx.launch.supervisor.Supervisor` adopts it;
* **spawn** (CUDA already initialised, or ``PHALANX_INTERACTIVE_START=spawn``): fresh
  ``python -m phalanx.interactive.replica`` processes started by the Supervisor connect back
  with the session's secret (:func:`~phalanx.launch.channel.accept_authenticated`).

Each replica is a :class:`NotebookReplica`: its process and its control
:class:`~phalanx.launch.channel.Channel`. What travels on the channel (cells, reports, interrupts)
is the session's (:mod:`phalanx.interactive.session`); this launcher only starts the replicas,
watches their channels (:meth:`NotebookLauncher.watch`), reaps them and stops them (``exit``, then
SIGKILL after :data:`EXIT_GRACE_S`), says where they are (:class:`~phalanx.launch.lifecycle.JobState`)
and how their run ended (:meth:`NotebookLauncher.result`, a :class:`~phalanx.launch.lifecycle.RunResult`).
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from phalanx.errors import ClusterSpecError, LaunchError, PhalanxError
from phalanx.launch.channel import Channel, accept_authenticated
from phalanx.launch.lifecycle import JobState, Lifecycle, RunResult
from phalanx.launch.root_cause import Running, Task, root_cause
from phalanx.launch.supervisor import Supervisor

__all__ = ["EXIT_GRACE_S", "SPAWN_TIMEOUT_S", "START_ENV", "NotebookLauncher", "NotebookReplica", "start_method"]

START_ENV = "PHALANX_INTERACTIVE_START"  # "fork" | "spawn" | unset (fork unless CUDA is initialised)
EXIT_GRACE_S = 2.0  # replicas asked to exit get this long before SIGKILL
SPAWN_TIMEOUT_S = 120.0  # a spawned replica connects back within this long


def start_method() -> str:
    """How a session starts its replicas: ``PHALANX_INTERACTIVE_START``, else fork unless CUDA is initialised.

    Raises:
        ClusterSpecError: the variable is neither ``fork`` nor ``spawn``.
    """
    from phalanx import config

    raw = config.settings().interactive_start or ""
    if raw not in ("", "fork", "spawn"):
        raise ClusterSpecError(
            START_ENV, raw, "must be fork or spawn", hint="leave it unset: fork, or spawn once CUDA is initialised"
        )
    if raw:
        return raw
    torch = sys.modules.get("torch")
    return "spawn" if torch is not None and torch.cuda.is_initialized() else "fork"


def describe_end(code: int | None) -> str:
    """How a replica ended, as a session says it (``"was killed by SIGKILL"``)."""
    if code is None:
        return "closed its control connection"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class NotebookReplica:
    """A replica as the session sees it: its process, which the launcher's Supervisor started (or
    adopted, when forked from this process) and reaps, and its control connection."""

    def __init__(self, rank: int, run: Running, channel: Channel) -> None:
        self.rank, self.run, self.channel = rank, run, channel
        self.pid = run.pid
        self.exit: str | None = None  # how it ended, once it has

    def poll(self) -> int | None:
        """Its exit status if it ended (reaped), else None."""
        return self.run.popen.poll()


class NotebookLauncher:
    """Starts (fork or spawn), reaps and stops the replicas 1..N-1 of an interactive session.

    Args:
        world_size: the session's replicas, this process (replica 0) included.
        method: ``fork`` or ``spawn`` (default: :func:`start_method`).
        log_dir: the run directory: ``replica_<k>.log`` for each replica.
    """

    def __init__(self, world_size: int, method: str, log_dir: str) -> None:
        self.world_size, self.method, self.log_dir = world_size, method, log_dir
        self.lifecycle = Lifecycle()
        self.replicas: dict[int, NotebookReplica] = {}
        # Starts (spawn), adopts (fork), reaps and stops the replicas: the one Supervisor of
        # every launcher.
        self.supervisor = Supervisor()

    @property
    def state(self) -> JobState:
        """Where the replicas are (:mod:`phalanx.launch.lifecycle`)."""
        return self.lifecycle.state

    def result(self) -> RunResult:
        """How the run stands, or ended: the state, every replica's end and the root cause."""
        self.supervisor.poll()  # ends not yet recorded (a replica reaped by its exit status only)
        exits = tuple(self.supervisor.exits)
        failed = self.state is JobState.FAILED
        cause = root_cause(exits) if failed else None
        return RunResult(self.state, (cause.status or 1) if cause is not None else int(failed), exits, cause)

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"replica_{rank}.log")

    def tail(self, rank: int, lines: int = 15) -> str:
        """The last lines of replica ``rank``'s log ("(no log)" when there is none)."""
        try:
            with open(self.log_path(rank), "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------ starting
    def fork(self, become: Callable[[int, Channel], Any]) -> Any:
        """Forks replicas 1..N-1. In a child, returns ``become(rank, channel)``: what the session
        makes of the child (it never comes back into the parent's loop); in the parent, None."""
        sys.stdout.flush()
        sys.stderr.flush()
        for rank in range(1, self.world_size):
            ours, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                ours.close()
                for replica in self.replicas.values():
                    replica.channel.close()
                return become(rank, Channel(theirs))
            theirs.close()
            run = self.supervisor.adopt(Task(name=f"replica {rank}", command=(), log_path=self.log_path(rank)), pid)
            self.replicas[rank] = NotebookReplica(rank, run, Channel(ours))
        self.lifecycle.to(JobState.RUNNING)
        return None

    def spawn(self) -> None:
        """Starts replicas 1..N-1 as fresh processes and waits until each has connected back.

        Raises:
            LaunchError: a replica ended before it connected (its log's last lines say why).
        """
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(self.world_size)
        secret = secrets.token_hex(32)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        # The kernel's own phalanx identity (a kernel started by a launcher) is not its replicas'.
        unset = tuple(k for k in os.environ if k.startswith("PHALANX_") and k != "PHALANX_LOG_ROOT")
        runs: dict[int, Running] = {}
        try:
            for rank in range(1, self.world_size):
                env = {
                    "PHALANX_INTERACTIVE_RANK": str(rank),
                    "PHALANX_INTERACTIVE_ADDR": address,
                    "PHALANX_INTERACTIVE_SECRET": secret,
                }
                command = (sys.executable, "-m", "phalanx.interactive.replica")
                task = Task(name=f"replica {rank}", command=command, env=env, log_path=self.log_path(rank), unset=unset)
                runs[rank] = self.supervisor.start(task)

            def check() -> None:
                for rank, run in runs.items():
                    if run.popen.poll() is not None:
                        raise LaunchError(
                            f"Replica {rank} (pid {run.pid}) {describe_end(run.popen.returncode)} "
                            f"before it connected. Last lines of {self.log_path(rank)}:\n"
                            f"{self.tail(rank)}"
                        )

            for _ in runs:
                channel, rank = accept_authenticated(listener, secret, SPAWN_TIMEOUT_S, check)
                self.replicas[rank] = NotebookReplica(rank, runs[rank], channel)
        except BaseException:
            self.supervisor.kill(list(runs.values()))
            self.lifecycle.to(JobState.FAILED)
            raise
        finally:
            listener.close()
        self.lifecycle.to(JobState.RUNNING)

    # ------------------------------------------------------------------ watching
    def watch(
        self,
        on_message: Callable[[NotebookReplica, dict], None],
        on_exit: Callable[[NotebookReplica, int | None], None],
        closed: Callable[[], bool],
    ) -> None:
        """Reads the replicas' control channels until every replica has ended, or ``closed()``.

        Each message goes to ``on_message(replica, message)``. A channel that closes is a replica
        that ended: it is reaped (:meth:`reap`) and ``on_exit(replica, status)`` is told how.
        """
        while not closed():
            live = [r for r in self.replicas.values() if r.exit is None]
            if not live:
                return
            try:
                readable, _, _ = select.select([r.channel for r in live], [], [], 0.1)
            except (OSError, ValueError):
                if closed():
                    return
                continue
            for channel in readable:
                replica = next(r for r in live if r.channel is channel)
                try:
                    message = replica.channel.recv()
                except (PhalanxError, ValueError):
                    message = None
                if message is None:
                    on_exit(replica, self.reap(replica))
                else:
                    on_message(replica, message)

    def reap(self, replica: NotebookReplica, wait: float = 1.0) -> int | None:
        """``replica``'s exit status once its channel closed (it may take ``wait`` seconds to end);
        its end is recorded for :meth:`result`."""
        code = None
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            code = replica.poll()
            if code is not None:
                break
            time.sleep(0.01)
        if code is not None:
            self.supervisor.poll()
        return code

    def wait_for_end(self, timeout: float) -> NotebookReplica | None:
        """Waits, up to ``timeout`` seconds each, for every replica to end by itself (a program's
        replicas run it to its end); returns the first that failed, if any."""
        failed = None
        for replica in self.replicas.values():
            deadline = time.monotonic() + timeout
            while replica.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if replica.poll() and failed is None:
                failed = replica
        self.supervisor.poll()
        return failed

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to every replica still running."""
        for replica in self.replicas.values():
            if replica.exit is None:
                replica.run.popen.send_signal(sig)  # never a pid already reaped (and maybe reused)

    # ------------------------------------------------------------------ ending
    def stop(self, graceful: bool) -> None:
        """Stops the replicas: asked to ``exit`` first when ``graceful``, then SIGKILL."""
        self.lifecycle.to(JobState.STOPPING)
        if graceful:
            for replica in self.replicas.values():
                try:
                    replica.channel.send({"op": "exit"})
                except OSError:
                    pass
            deadline = time.monotonic() + EXIT_GRACE_S
            while time.monotonic() < deadline and any(r.poll() is None for r in self.replicas.values()):
                time.sleep(0.01)
        self.supervisor.kill([r.run for r in self.replicas.values() if r.poll() is None])
        self.supervisor.poll()  # their ends, stopped by the supervisor, for result()
        for replica in self.replicas.values():
            if replica.exit is None:
                replica.exit = "was stopped"

    def close(self, status: int) -> None:
        """Closes the control connections; the run ends with ``status`` (0: succeeded)."""
        for replica in self.replicas.values():
            replica.channel.close()
        self.lifecycle.end(status)
