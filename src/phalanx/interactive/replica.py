"""The replica side of an interactive session: run every cell the interactive main sends.

A replica is either *forked* from the interactive process while it constructs the strategy (it
then finishes that cell or statement itself, as replica ``k``, and serves the following ones), or
*spawned* fresh (``python -m phalanx.interactive.replica``) and brought to the kernel's state by
replaying the cells executed so far. Either way it runs cells in order in its own ``__main__``
namespace and reports each one's outcome (ok, or the traceback text) to replica 0.

What a replica does not do, so that the user sees things once: shell escapes (``!cmd``,
``%system``, ``%pip``, ``%%bash`` and other subprocess cell magics) are skipped; display calls
and printed output go to its log file; ``input()`` raises ``EOFError``.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import io
import os
import signal
import socket
import sys
import traceback
from typing import Any

from phalanx._compat.python import set_traceback_printer
from phalanx.errors import LaunchError
from phalanx.interactive import step_hook
from phalanx.interactive.control import Control
from phalanx.launch.channel import Channel
from phalanx.launch.env import ReplicaEnv
from phalanx.launch.forkserver import die_with_parent
from phalanx.launch.lifecycle import JobState
from phalanx.launch.mode import JobMode

# Cell magics that start a program: run by replica 0 only.
_SHELL_CELL_MAGICS = frozenset(
    {"bash", "sh", "script", "system", "sx", "perl", "ruby", "pypy", "python2", "python3", "writefile"}
)


class ReplicaSession:
    """Replica ``rank`` of an interactive session (see the module docstring)."""

    def __init__(
        self, rank: int, world_size: int, channel: Channel, control: Control, env: ReplicaEnv, mode: str, shell: Any
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.channel, self.control, self.env = channel, control, env
        self.mode, self.shell = mode, shell
        self.steps = 0
        self._strategies = 0
        self.replaying = False  # running the cells before the one that started the session

    # ------------------------------------------------------------------ used by strategies
    @property
    def state(self) -> JobState:
        """A replica serves its session's cells until replica 0 ends the session: running."""
        return JobState.RUNNING

    def env_for(self, strategy: Any, world_size: int) -> ReplicaEnv:
        """The identity of the next strategy this replica constructs (the order is the cells')."""
        if self.replaying:
            raise LaunchError(
                "A multi-replica strategy of an earlier cell is not recreated while a spawned "
                "replica replays the history (its replicas are gone); the cell that starts "
                "this session does that."
            )
        index, self._strategies = self._strategies, self._strategies + 1
        if index == 0:
            return self.env
        self.channel.send({"op": "port", "index": index, "world_size": world_size})
        reply = self.channel.recv()
        if reply is None or reply.get("op") != "port" or reply.get("port") is None:
            raise LaunchError(
                f"Replica {self.rank} got no address for strategy {index} from replica 0 "
                f"({(reply or {}).get('error', 'connection closed')})."
            )
        return ReplicaEnv(**{**self.env.__dict__, "master_port": int(reply["port"])})

    def check_peers(self) -> None:
        """Replica 0 watches the session's replicas; nothing to raise here."""

    def strategy_opened(self, strategy: Any) -> None:
        """Replica 0 counts the session's strategies; nothing to do here."""

    def strategy_closed(self, strategy: Any) -> None:
        """Replica 0 decides when the session ends; nothing to do here."""

    def before_step(self) -> None:
        self.steps += 1
        self.control.set_steps(self.rank, self.steps)
        stop = self.control.stop
        if stop and self.steps >= stop:
            raise step_hook.InterruptedAtStep(self.steps)

    # ------------------------------------------------------------------ serving cells
    def run_source(self, source: str) -> BaseException | None:
        """Runs one cell or statement in ``__main__``; returns its exception, if any."""
        if self.shell is not None:
            result = self.shell.run_cell(source, store_history=False, silent=True)
            return result.error_before_exec or result.error_in_exec
        try:
            code = compile(source, "<stdin>", "single")
            exec(code, sys.modules["__main__"].__dict__)
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001 - reported to replica 0, which fails the cell
            traceback.print_exc()
            return e
        return None

    def report(self, cell: int, error: BaseException | None) -> None:
        text = "".join(traceback.format_exception(error)) if error is not None else ""
        self.channel.send(
            {
                "op": "done",
                "id": cell,
                "ok": error is None,
                "error": text,
                "type": type(error).__name__ if error is not None else "",
            }
        )

    def serve(self) -> None:
        """Runs the cells replica 0 sends until it says to exit or goes away."""
        while True:
            try:
                message = self.channel.recv()
            except KeyboardInterrupt:  # an interrupt that arrived between cells
                continue
            if message is None or message.get("op") == "exit":
                return
            op = message.get("op")
            if op == "cell":
                self._run_and_report(int(message["id"]), [message["source"]])
            elif op == "replay":
                self._run_and_report(0, list(message["cells"]))

    def _run_and_report(self, cell: int, sources: list[str]) -> None:
        error: BaseException | None = None
        try:
            for i, source in enumerate(sources):
                self.steps = 0
                self.replaying = i < len(sources) - 1
                error = self.run_source(source)
                if error is not None and i < len(sources) - 1:
                    print(f"phalanx: replayed cell {i + 1} failed here too; going on", file=sys.stderr)
        except KeyboardInterrupt as e:
            error = e
        finally:
            self.replaying = False
        while True:
            try:
                self.report(cell, error)
                return
            except KeyboardInterrupt:
                continue
            except OSError:
                return


def quiet_shell(shell: Any) -> None:
    """Makes this replica's IPython shell run programs, show displays and read input nowhere visible.

    These are attributes of this process's own shell object (a fork's copy, or a fresh one), set
    once when it becomes a replica.
    """
    from IPython.core.displaypub import DisplayPublisher
    from IPython.utils.text import SList

    run_line_magic = shell.run_line_magic  # before the replica's own cell magic wrapper below
    shell.system = lambda cmd: print(f"[replica: skipped shell command] {cmd}")
    shell.getoutput = lambda *a, **k: SList()
    shell.display_pub = DisplayPublisher(shell=shell)  # prints text/plain to stdout: the log
    set_traceback_printer(shell, lambda etype, evalue, stb: print("\n".join(stb), file=sys.stderr))
    run_cell_magic = shell.run_cell_magic

    def cell_magic(name: str, line: str, cell: str) -> Any:
        if name in _SHELL_CELL_MAGICS:
            print(f"[replica: skipped %%{name}]")
            return None
        return run_cell_magic(name, line, cell)

    shell.run_cell_magic = cell_magic
    # Through IPython's own magics, the public API of every version: IPython 9 renamed the colour
    # schemes ("NoColor" became the theme "nocolor") and deprecated ``set_colors``; lowercase names
    # were accepted by IPython 8 too. The rich traceback mode takes seconds on a Keras stack, and
    # colours would be escape codes in a log file.
    with contextlib.redirect_stdout(io.StringIO()):  # "Exception reporting mode: Plain"
        run_line_magic("xmode", "plain")
        run_line_magic("colors", "nocolor")
    shell.set_custom_exc((step_hook.InterruptedAtStep,), step_hook.short_traceback)


def _no_input(prompt: str = "") -> str:
    raise EOFError("input() has no terminal on a phalanx replica; read input before creating the strategy")


def redirect_output(log_path: str) -> None:
    """Sends this process's stdout and stderr (file descriptors too) to its log; stdin is empty."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    builtins.input = _no_input


class _ReplicaPrompt:
    """sys.ps1 of a forked REPL replica: when the C REPL asks for the next statement, serve instead."""

    def __init__(self, session: ReplicaSession) -> None:
        self.session = session
        self.last_error = getattr(sys, "last_value", None)

    def __str__(self) -> str:
        try:
            error = getattr(sys, "last_value", None)  # where the C REPL leaves a statement's exception
            self.session.report(0, error if error is not self.last_error else None)
            self.session.serve()
        except BaseException:
            _die(1)
        _die(0)


_INHERITED: list[Any] = []  # the parent's communicators, kept alive in a forked child (see below)


def _keep_inherited_communicators() -> None:
    """Never lets a forked child destroy the parent's stores and process groups.

    Their C++ destructors join threads (a TCPStore's daemon, gloo's run loops) that exist only in
    the parent, so in the child they wait forever: a strategy replaced or closed before this fork,
    freed later in the child, would hang it. The child ends with ``os._exit``; nothing is lost.
    """
    for obj in gc.get_objects():
        module = type(obj).__dict__.get("__module__")
        if isinstance(module, str) and module.startswith(("phalanx.comm", "torch.distributed")):
            _INHERITED.append(obj)


def become_forked_replica(session: ReplicaSession, parent_pid: int, log_path: str) -> None:
    """In a child just forked from the interactive main: turn it into replica ``session.rank``.

    The child goes on running the cell (or statement) that constructs the strategy, as replica
    ``rank``; it is taken over once that unit ends (IPython: ``post_run_cell``; REPL: the next
    prompt). In ``python -c``/stdin mode it simply runs the rest of the program.
    """
    # Until this child ends with os._exit, nothing may return into the parent's kernel machinery:
    # an exception here would end the cell in the child, and ipykernel would then answer the
    # request on the kernel's ZMQ sockets, which are the parent's ("attempted to send message
    # from fork"). So every step of becoming a replica fails into the log and os._exit(1); the
    # parent sees the replica die and fails the strategy's cell with this traceback.
    try:
        _keep_inherited_communicators()
        # Its own group: Ctrl-C in a terminal reaches replica 0 only; it decides how to stop the rest.
        die_with_parent(parent_pid, own_group=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        redirect_output(log_path)
        step_hook.attach(session, JobMode.NOTEBOOK_REPLICA)
        if session.mode == "ipython":
            quiet_shell(session.shell)
            # Replica 0 registers its own callbacks after the fork: this copy of the shell has none of them.
            session.shell.events.register("post_run_cell", lambda result: _take_over(session, result))
        elif session.mode == "repl":
            sys.ps1 = _ReplicaPrompt(session)
    except BaseException:
        _die(1)


def _take_over(session: ReplicaSession, result: Any) -> None:
    """IPython's ``post_run_cell`` in a forked replica: report the cell that forked it, then serve.

    Never returns: IPython would catch an exception from an event callback and go back into the
    kernel, whose sockets belong to the parent.
    """
    try:
        error = (result.error_before_exec or result.error_in_exec) if result is not None else None
        session.report(0, error)
        session.serve()
    except BaseException:
        _die(1)
    _die(0)


def _die(code: int) -> None:
    """Ends a forked replica here: its traceback (if any) to its log, then ``os._exit``."""
    if code:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


def main() -> None:
    """Entry point of a spawned replica (``python -m phalanx.interactive.replica``)."""
    rank = int(os.environ.pop("PHALANX_INTERACTIVE_RANK"))
    host, port = os.environ.pop("PHALANX_INTERACTIVE_ADDR").rsplit(":", 1)
    secret = os.environ.pop("PHALANX_INTERACTIVE_SECRET")
    # Dies with the kernel already: its Supervisor started it (launch.forkserver.die_with_parent).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.settimeout(None)
    channel = Channel(sock)
    channel.send({"op": "hello", "rank": rank, "secret": secret})
    init = channel.recv()
    if init is None or init.get("op") != "init":
        raise LaunchError("Replica 0 closed the control connection before the session started.")
    env = ReplicaEnv(**init["env"])
    control = Control(env.world_size, init["control"], create=False)
    builtins.input = _no_input
    try:
        import torch

        if torch.cuda.is_available() and rank < torch.cuda.device_count():
            torch.cuda.set_device(rank)  # the replayed cells allocate on this replica's own GPU
    except ImportError:
        pass
    shell = None
    if init["mode"] == "ipython":
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
        quiet_shell(shell)  # IPython made its user namespace this process's __main__
    session = ReplicaSession(rank, env.world_size, channel, control, env, init["mode"], shell)
    step_hook.attach(session, JobMode.NOTEBOOK_REPLICA)
    session.serve()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
