"""Replica 0 of an interactive session: start the other replicas and ship them every cell.

In a Jupyter/IPython kernel, IPython's terminal, the plain REPL, ``python -c`` or ``python -``,
there is no script to start again, so constructing a multi-replica strategy starts a
:class:`Session`. Its :class:`~phalanx.launch.notebook.NotebookLauncher` makes N-1 replica
processes (and reaps and stops them); the session keeps the cells, the interrupts and the console:

* **fork** (default): each child is a copy of the interactive process at the moment the strategy
  is constructed, so every variable defined before (data, a model built without a strategy)
  exists there. The child finishes that cell as replica ``k``, then serves the following ones.
* **spawn** (when CUDA is already initialised, which forbids forking, or when forced with
  ``PHALANX_INTERACTIVE_START=spawn``): fresh processes replay the cells executed so far (IPython
  keeps them), each on its own device, and construct the strategy as replica ``k``.

Then every cell replica 0 runs is shipped to the replicas first (IPython's ``pre_run_cell``
event; the REPL is read by :mod:`phalanx.interactive.console`) and run there in order. After the cell,
replica 0 waits for every replica's outcome: a failure on any replica fails the cell with that
replica's traceback; a dead replica is named, the others are stopped, and the notebook stays
usable (the next cell says the strategy is gone; a new strategy starts new replicas).

Interrupts (:class:`~phalanx.interactive.interrupts.Interrupts`, which the session holds; IPython's
events and the REPL's prompt are :mod:`phalanx.interactive.console`'s). Replicas are in their own
process group: the kernel's SIGINT reaches replica 0 only. If a strategy step has run in the cell,
replica 0 chooses a stop step just past every replica's current one (shared counters,
:mod:`phalanx.interactive.control`), and every replica raises ``KeyboardInterrupt`` when it starts
that step, so they all stop after the same number of complete steps and stay in step. Otherwise (or
at a second interrupt, or if no step starts within
:data:`~phalanx.interactive.interrupts.ESCALATE_S`) every replica is interrupted at once. A
replica's report that it stopped as asked is not a failure of the cell: replica 0 is stopping too,
and the others get :data:`~phalanx.interactive.interrupts.MAX_AGREED_STOP_S` to end the cell (a
loaded host can take seconds to unwind a Keras ``fit``) before they are interrupted anywhere.

Ending. ``strategy.close()`` of the last strategy, the kernel's shutdown or restart, and the end
of the REPL stop the replicas (``exit``, then SIGKILL after
:data:`~phalanx.launch.notebook.EXIT_GRACE_S`); a replica also dies with its parent
(``PR_SET_PDEATHSIG``) and leaves no shared-memory segment.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any

from phalanx.errors import LaunchError, PhalanxError
from phalanx.interactive import console, step_hook
from phalanx.interactive.control import Control
from phalanx.interactive.interrupts import FAILURE_GRACE_S, MAX_AGREED_STOP_S, Interrupts
from phalanx.interactive.replica import ReplicaSession, become_forked_replica
from phalanx.launch.channel import Channel
from phalanx.launch.env import ReplicaEnv, free_port
from phalanx.launch.lifecycle import JobState
from phalanx.launch.mode import JobMode, interactive_mode, ipython_shell
from phalanx.launch.notebook import SPAWN_TIMEOUT_S, NotebookLauncher, NotebookReplica, describe_end, start_method
from phalanx.launch.run_dir import new_run_id
from phalanx.launch.settings import log_root


class ReplicaCellError(PhalanxError):
    """A cell failed on another replica (its traceback is in the message), or a replica died."""

    def __init__(self, rank: int, what: str, detail: str) -> None:
        self.rank = rank
        super().__init__(f"replica {rank} {what}:\n{detail}".rstrip())


class Session:
    """Replica 0's side of an interactive session (see the module docstring)."""

    rank = 0

    def __init__(self, world_size: int, mode: str, method: str | None = None) -> None:
        self.world_size, self.mode = world_size, mode
        self.method = method or start_method()
        self.run_id = new_run_id()
        self.log_dir = os.path.join(log_root(), self.run_id)
        os.makedirs(self.log_dir, exist_ok=True)
        self.env = ReplicaEnv.local_chief(world_size, self.run_id, self.log_dir)
        self.shell = ipython_shell() if mode == "ipython" else None
        # Starts (fork or spawn), reaps and stops the replicas, through the one Supervisor of every
        # launcher; this session keeps cells, interrupts and the console.
        self.launcher = NotebookLauncher(world_size, self.method, self.log_dir)
        self.replicas = self.launcher.replicas
        self.control = Control(world_size, os.path.join(self.log_dir, "control") if self.method == "spawn" else None)
        self.ports: list[int | None] = [self.env.master_port]
        self.strategies: list[weakref.ref] = []
        self.cell = 0
        self.steps = 0
        self.running = False
        self.broken: str | None = None
        self._told_broken = False
        self.closed = False
        self._done: dict[int, dict] = {}
        self._cond = threading.Condition()
        # The user's interrupt and a replica's failure, reaching every replica (interrupts.py).
        self.interrupts = Interrupts(self, self._cond)
        self._watcher: threading.Thread | None = None
        self.shell_events: console.ShellEvents | None = None  # IPython's pre/post_run_cell (console.py)
        self._exit_code = 0

    def log_path(self, rank: int) -> str:
        return self.launcher.log_path(rank)

    @property
    def state(self) -> JobState:
        """Where the session's replicas are (its launcher's :class:`~phalanx.launch.lifecycle.JobState`)."""
        return self.launcher.state

    # ------------------------------------------------------------------ starting
    def launch(self, strategy: Any) -> tuple[Any, ReplicaEnv]:
        """Starts replicas 1..N-1. Returns ``(session, env)`` for this process: in a forked child,
        the child's own :class:`ReplicaSession` and identity."""
        _check_start_method(self.mode, self.method)
        started = time.perf_counter()
        step_hook.attach(self, JobMode.NOTEBOOK_SESSION)
        try:
            if self.method == "fork":
                child = self._fork()
                if child is not None:
                    child._strategies = 1
                    return child, child.env
            else:
                self._spawn()
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - started
        self.strategies.append(weakref.ref(strategy))
        self._watcher = threading.Thread(
            target=self.launcher.watch,
            args=(self._on_message, self._on_exit, lambda: self.closed),
            name="phalanx-interactive-watch",
            daemon=True,
        )
        self._watcher.start()
        atexit.register(self.close)
        self.running = True  # the cell constructing the strategy runs on every replica now
        self.shell_events = console.attach(self, self.mode, self.shell)  # cells reach every replica
        what = "the rest of the program" if self.mode == "program" else "every cell from this one on"
        print(
            f"phalanx: started replicas 1..{self.world_size - 1} ({self.method}); they run {what}. "
            f"Their output is in {self.log_dir}/replica_<k>.log",
            file=sys.stderr,
            flush=True,
        )
        return self, self.env

    def _replica_env(self, rank: int) -> ReplicaEnv:
        return ReplicaEnv(**{**self.env.__dict__, "rank": rank, "local_rank": rank})

    def _fork(self) -> ReplicaSession | None:
        parent = os.getpid()

        def become(rank: int, channel: Channel) -> ReplicaSession:
            child = ReplicaSession(
                rank, self.world_size, channel, self.control, self._replica_env(rank), self.mode, self.shell
            )
            become_forked_replica(child, parent, self.log_path(rank))
            return child

        return self.launcher.fork(become)

    def _spawn(self) -> None:
        self.launcher.spawn()
        cells = self._history()
        for rank, replica in self.replicas.items():
            replica.channel.send(
                {"op": "init", "env": self._replica_env(rank).__dict__, "mode": self.mode, "control": self.control.path}
            )
            replica.channel.send({"op": "replay", "cells": cells})

    def _history(self) -> list[str]:
        """The cells this kernel ran so far, the current one (which constructs the strategy) last."""
        return [cell for cell in self.shell.history_manager.input_hist_raw[1:]]

    # ------------------------------------------------------------------ strategies
    def env_for(self, strategy: Any, world_size: int) -> ReplicaEnv:
        """A further strategy in this session: same replica processes, a new process group."""
        if world_size != self.world_size:
            with self._cond:
                self.ports.append(None)
                self._cond.notify_all()
            raise LaunchError(
                f"This session's replicas are {self.world_size} processes; a strategy over "
                f"{world_size} devices cannot use them.",
                hint="call strategy.close() on the session's strategies first (a cell of its "
                "own), then create the new one",
            )
        with self._cond:
            port = free_port()
            self.ports.append(port)
            self._cond.notify_all()
        self.strategies.append(weakref.ref(strategy))
        return ReplicaEnv(**{**self.env.__dict__, "master_port": port})

    def strategy_opened(self, strategy: Any) -> None:
        """A strategy runs on this session's replicas (:meth:`env_for` has counted it already)."""

    def strategy_closed(self, strategy: Any) -> None:
        """Called by ``strategy.close()``; the session ends after the cell once none is left."""
        self.strategies = [r for r in self.strategies if r() is not None and r() is not strategy]

    def _answer_port(self, replica: NotebookReplica, message: dict) -> None:
        index = int(message["index"])
        with self._cond:
            self._cond.wait_for(lambda: len(self.ports) > index or self.closed, timeout=SPAWN_TIMEOUT_S)
            port = self.ports[index] if len(self.ports) > index else None
        try:
            replica.channel.send({"op": "port", "port": port, "error": "replica 0 refused the strategy"})
        except OSError:
            pass

    def check_peers(self) -> None:
        """Raises the first dead replica's failure; called while a strategy's rendezvous waits.

        A replica that died while the strategy was being created (a fork that failed to become a
        replica, a spawned one whose replay failed) never arrives: waiting for it until the
        rendezvous timeout would only end in a hint about networking. Its exit is known here
        (the watcher recorded it), and so is the end of its log, which holds its traceback.

        Raises:
            ReplicaCellError: a replica of this session has exited.
        """
        dead = [r for r in self.replicas.values() if r.exit is not None]
        if dead:
            first = min(dead, key=lambda r: r.rank)
            raise ReplicaCellError(
                first.rank,
                f"(pid {first.pid}) {first.exit} while the strategy was being created",
                f"last lines of {self.log_path(first.rank)}:\n{self._tail(first.rank)}",
            )

    # ------------------------------------------------------------------ steps and interrupts
    def before_step(self) -> None:
        self.steps += 1
        self.control.set_steps(0, self.steps)
        stop = self.control.stop
        if stop and self.steps >= stop:
            self.interrupts.stopped = True
            raise step_hook.InterruptedAtStep(self.steps)

    def peer_error(self) -> ReplicaCellError | None:
        """The error replica 0 is interrupted with after another replica failed this cell."""
        failure = self.interrupts.peer_failure
        if failure is None or failure[0] != self.cell:
            return None
        rank = failure[1]
        report = self._done.get(rank, {})
        return ReplicaCellError(
            rank,
            f"(pid {self.replicas[rank].pid}) failed in this cell, as shown in {self.log_path(rank)}; "
            "replica 0 was still running the cell (waiting for it in a collective?) and was stopped",
            report.get("error", ""),
        )

    # ------------------------------------------------------------------ cells
    def before_cell(self, source: str) -> None:
        """Ships ``source`` to every replica, then lets replica 0 run it."""
        if self.closed:
            return
        if self.broken:
            if not self._told_broken:
                self._told_broken = True
                print(
                    f"phalanx: this strategy's replicas are gone ({self.broken}); cells run on this "
                    "process only. Create a new strategy to start new replicas.",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self.cell += 1
        self.steps = 0
        self.interrupts.start_cell()
        self.control.reset()
        with self._cond:
            self._done.clear()
        for replica in self.replicas.values():
            if replica.exit is None:
                try:
                    replica.channel.send({"op": "cell", "id": self.cell, "source": source})
                except OSError:
                    pass
        self.running = True
        self.interrupts.catch_sigint()

    def after_cell(self, error: BaseException | None) -> ReplicaCellError | None:
        """Waits for every replica to finish the cell; returns the error the cell should fail with."""
        if not self.running:
            return None
        with self._cond:  # _peer_failed interrupts replica 0 only while this is True
            self.running = False
        self.interrupts.end_cell()
        trouble_since = time.monotonic() if error is not None else None
        # Replica 0 stopped at the agreed step: the others stop there too, with no collective left
        # to wait in; on a loaded host unwinding a Keras fit and reporting can take seconds.
        grace = MAX_AGREED_STOP_S if isinstance(error, step_hook.InterruptedAtStep) else FAILURE_GRACE_S
        interrupted = killed = False
        while True:
            with self._cond:
                pending = [r for r in self.replicas.values() if r.rank not in self._done and r.exit is None]
                failed = [
                    r
                    for r in self.replicas.values()
                    if r.exit is not None or not self._done.get(r.rank, {"ok": True})["ok"]
                ]
                if not pending:
                    break
                if failed and trouble_since is None:
                    trouble_since = time.monotonic()
                try:
                    self._cond.wait(0.05)
                except KeyboardInterrupt:  # the user interrupts the wait: no more grace
                    trouble_since = time.monotonic() - grace
            if trouble_since is not None and time.monotonic() - trouble_since > grace and not interrupted:
                interrupted = True
                self.launcher.signal(signal.SIGINT)
            if trouble_since is not None and time.monotonic() - trouble_since > grace + FAILURE_GRACE_S:
                killed = True
                break
        result = self._cell_failure(error)
        dead = [r for r in self.replicas.values() if r.exit is not None]
        # Only an error raised into the cell's own code stopped replica 0 mid-cell; one that came
        # as the cell was ending stopped nothing.
        peer_stopped = self.interrupts.stopped_by_peer(self.peer_error())
        if peer_stopped:
            # Replica 0 was stopped somewhere in the cell (in a collective, maybe half done) after
            # the others had left it: they are out of step, and a next collective could mix steps.
            self._break(f"replica 0 was stopped in cell {self.cell} after another replica failed it")
        elif dead and not killed:
            self._break(f"replica {dead[0].rank} {dead[0].exit}")
        elif killed:
            waiting = ", ".join(str(r.rank) for r in pending)
            self._break(
                f"replica(s) {waiting} could not finish cell {self.cell} (blocked in a collective "
                "after another replica stopped)"
            )
        if self.broken is None and not self.closed and not any(r() is not None for r in self.strategies):
            self.close()
        return result

    def _cell_failure(self, error: BaseException | None) -> ReplicaCellError | None:
        for replica in sorted(self.replicas.values(), key=lambda r: r.rank):
            report = self._done.get(replica.rank)
            if isinstance(error, ReplicaCellError) and error.rank == replica.rank:
                return None  # the cell failed with this replica's error already (check_peers, _peer_failed)
            if report is not None and not report["ok"]:
                if (
                    error is not None
                    and report.get("type") == type(error).__name__
                    and not isinstance(error, PhalanxError)
                ):
                    return None  # the same error everywhere: replica 0's own traceback says it all
                return ReplicaCellError(
                    replica.rank,
                    f"(pid {replica.pid}) failed in this cell, as shown in {self.log_path(replica.rank)}",
                    report["error"],
                )
            if report is None and replica.exit is not None:
                return ReplicaCellError(
                    replica.rank,
                    f"(pid {replica.pid}) {replica.exit}",
                    f"last lines of {self.log_path(replica.rank)}:\n{self._tail(replica.rank)}",
                )
        return None

    def _tail(self, rank: int, lines: int = 15) -> str:
        return self.launcher.tail(rank, lines)

    def _break(self, reason: str) -> None:
        """The replicas cannot go on in step: stop them; the next cell says so."""
        if self.broken is None:
            self.broken = reason
        self._stop_replicas(graceful=False)

    # ------------------------------------------------------------------ watching
    def _on_message(self, replica: NotebookReplica, message: dict) -> None:
        """A replica's report on its control channel (read by the launcher's watch)."""
        if message.get("op") == "done":
            with self._cond:
                if int(message["id"]) == self.cell:
                    self._done[replica.rank] = message
                    if not message.get("ok", True) and self.running and not self.interrupts.stopped_as_asked(message):
                        threading.Thread(
                            target=self.interrupts.peer_failed, args=(self.cell, replica.rank), daemon=True
                        ).start()
                self._cond.notify_all()
        elif message.get("op") == "port":
            threading.Thread(target=self._answer_port, args=(replica, message), daemon=True).start()

    def _on_exit(self, replica: NotebookReplica, code: int | None) -> None:
        """A replica ended (the launcher's watch reaped it with status ``code``)."""
        with self._cond:
            replica.exit = describe_end(code)
            self._cond.notify_all()
        if self.closed or (self.mode == "program" and code in (0, None)):
            return  # a replica at the end of the program; _finish_program reads its status
        if self.broken is not None and self.mode != "program":
            return  # stopped by this session (_break), which said why
        if code not in (0, None) and self._exit_code == 0:
            self._exit_code = 1
        if self.running and self.mode in ("ipython", "repl"):
            # The cell in progress fails with this replica's traceback (after_cell, or check_peers
            # in a rendezvous): say it now, show the traceback once, there.
            print(
                f"\nphalanx: replica {replica.rank} (pid {replica.pid}) {replica.exit}; this cell "
                "fails with its error.",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"\nphalanx: replica {replica.rank} (pid {replica.pid}) {replica.exit}. Last lines of "
                f"{self.log_path(replica.rank)}:\n{self._tail(replica.rank)}\n",
                file=sys.stderr,
                flush=True,
            )
        if self.mode == "program":
            threading.Thread(target=self._end_program_later, daemon=True).start()
            return
        if not self.running:
            self._break(f"replica {replica.rank} {replica.exit}")

    def _end_program_later(self) -> None:
        # The main thread normally fails at its next collective; if it cannot notice, end the job.
        time.sleep(5.0)
        if not self.closed:
            print("phalanx: replica 0 is stopping because a replica failed", file=sys.stderr, flush=True)
            self._stop_replicas(graceful=False)
            os._exit(1)

    # ------------------------------------------------------------------ ending
    def _stop_replicas(self, graceful: bool) -> None:
        self.launcher.stop(graceful)

    def close(self) -> None:
        """Stops the replicas and detaches from the shell; safe to call twice."""
        if self.closed:
            return
        if self.mode == "program":
            self._finish_program()
        self.closed = True
        step_hook.detach(self)
        if self.shell_events is not None:
            self.shell_events.detach()
        self._stop_replicas(graceful=True)
        self.launcher.close(self._exit_code)
        self.control.remove()
        with self._cond:
            self._cond.notify_all()

    def _finish_program(self) -> None:
        """``python -c``/stdin: replicas run the same program to its end; a failed one fails this one."""
        failed = self.launcher.wait_for_end(60.0)
        if failed is not None:
            self.closed = True
            self._stop_replicas(graceful=False)
            print(
                f"phalanx: root cause (first failure): replica {failed.rank} (pid {failed.pid}) "
                f"{describe_end(failed.poll())}. Last lines of {self.log_path(failed.rank)}:\n"
                f"{self._tail(failed.rank)}",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(1)


def _check_start_method(mode: str, method: str) -> None:
    """Raises :class:`LaunchError` where ``mode``'s replicas cannot be started by ``method``: spawned
    replicas replay the cells, which only IPython keeps."""
    if mode == "program" and method == "spawn":
        raise LaunchError(
            "A multi-replica strategy in `python -c` or `python -` cannot spawn fresh "
            "replicas (CUDA is initialised, or PHALANX_INTERACTIVE_START=spawn): "
            "there is no source to start them from.",
            hint="save the code to train.py and run `python train.py`",
        )
    if mode == "repl" and method == "spawn":
        raise LaunchError(
            "The plain Python REPL cannot spawn fresh replicas (CUDA is initialised, or "
            "PHALANX_INTERACTIVE_START=spawn): it keeps no history of what ran before.",
            hint="create the strategy before anything touches CUDA, or use IPython "
            "(`ipython`, Jupyter), which replays its history",
        )


def start(strategy: Any, world_size: int) -> tuple[Any, ReplicaEnv]:
    """The self-launch of an interactive main (see :func:`phalanx.launch.mode.interactive_mode`).

    Returns ``(launcher, env)``: the session (replica 0's or, in a forked child, the child's) and
    this process's identity.
    """
    current = step_hook.session
    if current is not None and (current.rank != 0 or not current.broken):
        return current, current.env_for(strategy, world_size)
    if current is not None:
        current.close()
    if os.environ.get("PYTEST_CURRENT_TEST") and "pytest" in sys.modules:
        # A pytest-xdist worker runs as `python -c`: forking it would copy the test session.
        raise LaunchError(
            "A multi-replica strategy cannot start its replicas from inside pytest.",
            hint="run the training code as a script (python train.py) or with `phalanx run -n N train.py`",
        )
    mode = interactive_mode()
    if mode is None:
        raise LaunchError("phalanx.interactive.start is for interactive mains only.")
    return Session(world_size, mode).launch(strategy)
