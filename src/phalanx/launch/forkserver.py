"""The fork start: import torch (and Keras) once per job, fork every replica from that.

``python train.py`` spends its first seconds importing: about 2.5 CPU-seconds for torch and 7
for Keras on its torch backend (which pulls in ``torch._dynamo`` and scikit-learn), measured on
the 2-core CI machine. A job of N replicas on a host paid that N times, all at once, on the
same cores. With the fork start (``phalanx run --start-method fork``, the default on Linux) the
supervisor starts one *fork server* per job, which imports those modules once and never runs
user code; each replica is a fork of it that then runs the program as ``python train.py``
would: a fresh ``__main__``, its ``sys.argv`` and ``sys.path[0]``, its own environment, process
group, stdin and stdout, and the interpreter's own exit (non-daemon threads joined, ``atexit``,
finalisation, the exit status, the traceback of an uncaught exception). A restarted replica is
forked from the same untouched server. Precedents: multiprocessing's forkserver with
``set_forkserver_preload``, gunicorn's ``--preload``, Android's zygote.

What can differ from a fresh interpreter, and what is done about it:

* **Environment read at start-up.** A task's variables are set before its program runs; the
  two that a fresh interpreter reads before any program code are applied by hand
  (``PYTHONUNBUFFERED``: the standard streams are rebuilt; ``OMP_NUM_THREADS``:
  ``torch.set_num_threads``). A task whose environment differs from the server's in anything
  else read at start-up or import (``PYTHON*``, ``LD_*``, ``KERAS_*``, ``TORCH*``, thread-pool
  sizes) is started fresh instead (:func:`forkable`).
* **Random state.** Python's ``random`` reseeds itself after a fork; numpy's global generator
  is reseeded here. torch's default generator is seeded at import with a constant, as in a
  fresh process. String hashing (``PYTHONHASHSEED``) is the server's in every replica, so set
  iteration orders agree across replicas (a fresh start gives each its own).
* **Fork safety.** The server starts no thread of its own and never initialises CUDA: importing
  torch does not, and Keras (whose import asks torch for CUDA devices) is preloaded only on a
  CPU-only torch build. numpy's and scipy's OpenBLAS pools are fork-aware (``pthread_atfork``).
* **Process tree.** Replicas are the server's children, not the supervisor's; the server
  reports each start and exit over its control socket, dies with the supervisor
  (``PR_SET_PDEATHSIG``) and takes its replicas with it the same way. An exit names the fork
  request that started the process, not only its pid: the kernel gives a reaped pid again, and
  a later child with it must never read as already ended with its predecessor's status.
* **Nested launches.** Each forked program gets a connection of its own to the server (a
  descriptor named in ``PHALANX_FORK_SERVER``, valid in that process only, as systemd's
  ``LISTEN_FDS``/``LISTEN_PID``): a supervisor in it (``python train.py`` that self-launches its
  other replicas, ``phalanx run`` itself forked) forks its tasks from the same server rather than
  importing torch again (:func:`inherited_server`). The server kills the tasks of a connection
  that closes, as a parent's death would (``PR_SET_PDEATHSIG``).

Example::

    >>> import os, sys
    >>> server = ForkServer(preload=())
    >>> proc = server.spawn([sys.executable, "-c", "import sys; sys.exit(3)"], env=dict(os.environ))
    >>> proc.wait(timeout=30)
    3
    >>> server.close()

This module is the client side (in the launcher) and the parts both sides share; the server's own
process, its loop and how a forked child becomes the program, is
:mod:`phalanx.launch.forkserver_process`.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx.errors import LaunchError
from phalanx.launch.fork_protocol import (
    _STARTUP,
    INHERIT_VARIABLE,
    _installed,
    _recv,
    _send,
    die_with_parent,
)

__all__ = [
    "ForkServer",
    "ForkedProcess",
    "ProcessHandle",
    "die_with_parent",
    "forkable",
    "has_inherited_server",
    "inherited_server",
    "preload_for",
]

_READY_TIMEOUT = 300.0  # importing torch and Keras on a loaded 2-core machine took up to 20 s

_APPLIED = frozenset({"PYTHONUNBUFFERED", "OMP_NUM_THREADS"})
# Read by torch at each use, not at import (torch/_inductor/runtime/cache_dir_utils.py); torch sets
# it in os.environ at a process's first optimizer step, so a launcher's later tasks carry it.
_READ_LATE = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
_KERAS_IMPORT = re.compile(rb"^\s*(import\s+keras|from\s+keras[\s.])", re.MULTILINE)
# os.environ["KERAS_BACKEND"] = "torch", os.environ.setdefault("KERAS_BACKEND", "torch"), ...
_PINS_TORCH_BACKEND = re.compile(rb"""["']KERAS_BACKEND["']\s*(\]\s*=|,)\s*["']torch["']""")


# ----------------------------------------------------------------------------- what to preload
def preload_for(
    command: Sequence[str], env: Mapping[str, str] | None = None, extra: Sequence[str] = ()
) -> tuple[str, ...]:
    """The modules worth importing once for ``command`` (``[python, script, ...]``): torch and
    numpy when installed, ``extra``, and Keras when the script imports it on the torch backend
    (``KERAS_BACKEND=torch`` in ``env``, or set to ``"torch"`` by the script itself). Keras is
    never preloaded for any other backend: the script would get the server's."""
    env = os.environ if env is None else env
    names = [m for m in ("numpy", "torch", "torch.distributed") if _installed(m)]
    script = _script_of(command)
    source = b""
    if script is not None:
        try:
            with open(script, "rb") as f:
                source = f.read()
        except OSError:
            pass
    wants_keras = "keras" in extra or bool(_KERAS_IMPORT.search(source))
    torch_backend = env.get("KERAS_BACKEND") == "torch" or (
        "KERAS_BACKEND" not in env and bool(_PINS_TORCH_BACKEND.search(source))
    )
    if wants_keras and torch_backend and _installed("keras"):
        names.append("keras")
    names += [m for m in extra if m != "keras" and m not in names]
    return tuple(names)


def _script_of(command: Sequence[str]) -> str | None:
    args = list(command[1:])
    return args[0] if args and not args[0].startswith("-") else None


def forkable(command: Sequence[str], env: Mapping[str, str], server_env: Mapping[str, str]) -> str | None:
    """Why ``command`` with ``env`` cannot be forked from a server started with ``server_env``
    (None when it can): only ``python script``, ``python -m module`` and ``python -c code``, with
    no interpreter option, and no difference in a variable read at start-up."""
    if not command or os.path.realpath(command[0]) != os.path.realpath(sys.executable):
        return f"not this Python: {command[:1]}"
    if len(command) < 2 or (command[1].startswith("-") and command[1] not in ("-m", "-c")):
        return f"interpreter options: {list(command[1:2])}"
    if command[1] in ("-m", "-c") and len(command) < 3:
        return f"{command[1]} without its argument"
    for name in set(env) | set(server_env):
        if name in _APPLIED or name in _READ_LATE:
            continue
        if _STARTUP.match(name) and env.get(name) != server_env.get(name):
            return f"{name} differs from the fork server's"
    return None


# ----------------------------------------------------------------------------- the client
def _this_process(fd: int, made: list[int]) -> int:
    """This process's standard descriptor ``fd`` for a task; /dev/null when it is closed (a
    daemon's), which a descriptor cannot be sent as."""
    try:
        os.fstat(fd)
        return fd
    except OSError:
        made.append(os.open(os.devnull, os.O_WRONLY))
        return made[-1]


_inherited_lock = threading.Lock()
_inherited_taken = False


def _inherited_connection() -> tuple[int, int] | None:
    """(descriptor, server pid) of this process's connection to the server it was forked from."""
    try:
        fd, server, owner = (int(part) for part in os.environ.get(INHERIT_VARIABLE, "").split(":"))
    except ValueError:
        return None
    # A process started from this one (exec'd, or forked by the program) inherits the variable,
    # not the connection: only the process the server forked may use it.
    return (fd, server) if owner == os.getpid() and fd > 2 else None


def has_inherited_server() -> bool:
    """Whether this process was forked by a fork server whose connection it has not used yet."""
    with _inherited_lock:
        return not _inherited_taken and _inherited_connection() is not None


def inherited_server(timeout: float = 30.0) -> ForkServer | None:
    """The fork server this process was forked from, to fork tasks of its own (once per process).

    A supervisor in a forked program (a script that self-launches its replicas; ``phalanx run``
    started by a fork server) forks its tasks from the server it came from: they start without
    importing torch again. They are the server's children, reported to this process, and killed
    by the server when this process's connection closes (:meth:`ForkServer.close`, or its death).
    Returns None when this process was not forked by a server, or its connection is taken.
    """
    global _inherited_taken
    with _inherited_lock:
        found = _inherited_connection()
        if _inherited_taken or found is None:
            return None
        _inherited_taken = True
    fd, server_pid = found
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        sock.detach()  # not ours after all: leave the descriptor to whoever owns it
        return None
    server = ForkServer(preload=(), env={})
    server._sock, server._inherited = sock, True
    try:
        _send(sock, {"op": "hello"})
    except OSError:
        server.close()
        return None
    hello = server._read_until(lambda m: m.get("op") == "hello", timeout)
    if hello is None or int(hello["pid"]) != server_pid:
        server.close()
        return None
    server.pid, server.preload, server.env = server_pid, tuple(hello["preloaded"]), dict(hello["env"])
    return server


class ProcessHandle:
    """The part of :class:`subprocess.Popen` a supervisor uses, for a process that ``Popen`` did not
    make (forked by a fork server, or by this process itself): ``poll`` says how it ended; waiting
    and signalling are built on it."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None:
        raise NotImplementedError

    def _pause(self, seconds: float) -> None:
        """Waits up to ``seconds`` for news of the process (a subclass may wake sooner)."""
        time.sleep(seconds)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self._pause(0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that may have been reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedProcess(ProcessHandle):
    """A task forked by a :class:`ForkServer`: the part of :class:`subprocess.Popen` a supervisor uses.

    Attributes:
        pid: its process id (its process group id too, unless it shares its server's group).
        returncode: its exit code once it has ended (``-N`` when killed by signal N), else None.
        stdout: the read end of its output pipe when it was started with ``stdout=PIPE``, else None.
    """

    def __init__(
        self, server: ForkServer, pid: int, stdout: io.BufferedReader | None = None, *, request: int | None = None
    ) -> None:
        self._server, self.pid, self.stdout = server, pid, stdout
        self._request = request  # the fork request that started it: its identity, which a pid is not
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._exit_code(self._request)
        return self.returncode

    def _pause(self, seconds: float) -> None:
        self._server._wait_for_news(seconds)  # woken by the server's report of an exit


class ForkServer:
    """A process that has imported ``preload`` and forks programs on request.

    Args:
        preload: modules to import in the server (an import that fails is reported on stderr
            and skipped: the replica will import, or fail to import, it itself).
        env: the server's environment (default ``os.environ``); see :func:`forkable`.

    The server starts on the first :meth:`spawn`; it dies with this process and ends when
    :meth:`close` is called (replicas still running then are killed with it).
    """

    def __init__(self, preload: Sequence[str] = ("numpy", "torch"), env: Mapping[str, str] | None = None) -> None:
        self.preload = tuple(preload)
        self.env = dict(os.environ if env is None else env)
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()
        # By fork request, never by pid: the kernel reuses a pid once its process is reaped, and an
        # exit kept by pid would be read as the end of the next child that gets the same pid (a
        # failed job read as exit 0 at once).
        self._exits: dict[int, int] = {}  # request id -> exit code
        self._started: dict[int, int] = {}  # request id -> pid
        self._next_id = 0
        self._inherited = False  # a connection to the server this process was forked from
        self.pid: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts the server and waits until it has imported its modules."""
        with self._lock:
            if self._proc is not None or self._inherited:
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            parent = os.getpid()
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "phalanx.launch.forkserver", str(theirs.fileno()), *self.preload],
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),),
                    preexec_fn=lambda: die_with_parent(parent),  # noqa: PLW1509 - async-signal-safe calls only
                )
            finally:
                theirs.close()
            self._sock = ours
            ready = self._read_until(lambda m: m.get("op") == "ready", _READY_TIMEOUT)
            if ready is None:
                self.close()
                raise LaunchError(
                    "The fork server did not start (its output, above, says why).",
                    hint="start replicas fresh with --start-method spawn (PHALANX_START_METHOD=spawn)",
                )
            self.pid = int(ready["pid"])

    @property
    def alive(self) -> bool:
        """Whether the server has not been started yet, or is running."""
        with self._lock:
            if self._inherited:
                return self._sock is not None
            return self._proc is None or (self._sock is not None and self._proc.poll() is None)

    def close(self) -> None:
        """Ends the server (and any replica of it still running); of an inherited server, this
        process's connection to it (and the replicas started through it)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ starting programs
    def spawn(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
        new_session: bool = False,
        own_group: bool = True,
    ) -> ForkedProcess:
        """Forks ``command`` (``[sys.executable, script | -m module | -c code, *args]``).

        Args:
            env: the program's whole environment (``os.environ`` in it).
            cwd: its working directory (default: this process's).
            stdout: a descriptor to write to, ``subprocess.PIPE`` (read it from
                ``ForkedProcess.stdout``), or None for this process's.
            stderr: a descriptor, ``subprocess.STDOUT``, or None for this process's.
            new_session: ``setsid()`` in the child (as ``start_new_session``).
            own_group: its own process group (ignored with ``new_session``).

        Raises:
            ValueError: ``command`` cannot be forked (:func:`forkable` says why).
        """
        why = forkable(command, env, self.env)
        if why is not None:
            raise ValueError(f"cannot fork {list(command)[:3]}: {why}")
        self.start()
        # Always this process's descriptors, never the server's: a server this process inherited
        # (inherited_server) writes where its own launcher does.
        fds, names, pipe_read, made = [], {"stdout": 0}, None, []
        if stdout == subprocess.PIPE:
            pipe_read, pipe_write = os.pipe()
            fds.append(pipe_write)
            made.append(pipe_write)
        else:
            fds.append(_this_process(1, made) if stdout is None else stdout)
        if stderr != subprocess.STDOUT:
            names["stderr"] = len(fds)
            fds.append(_this_process(2, made) if stderr is None else stderr)
        request = {
            "op": "fork",
            "argv": list(command[1:]),
            "env": dict(env),
            "cwd": cwd or os.getcwd(),
            "fds": names,
            "stderr_to_stdout": stderr == subprocess.STDOUT,
            "new_session": new_session,
            "own_group": own_group,
        }
        with self._lock:
            if self._sock is None:
                raise LaunchError(f"The fork server (pid {self.pid}) is gone; cannot start {list(command)[:3]}.")
            self._next_id += 1
            request["id"] = ident = self._next_id
            try:
                _send(self._sock, request, fds)
            except OSError as e:
                raise LaunchError(
                    f"The fork server (pid {self.pid}) is gone ({e}); cannot start {list(command)[:3]}."
                ) from e
            finally:
                for fd in made:
                    os.close(fd)  # the child has its own copy now
            reply = self._read_until(lambda m: m.get("op") == "started" and m.get("id") == ident, 60.0)
        if reply is None or "pid" not in reply:
            if pipe_read is not None:
                os.close(pipe_read)
            raise LaunchError(f"The fork server (pid {self.pid}) did not start {list(command)[:3]}: {reply}.")
        reader = os.fdopen(pipe_read, "rb", buffering=0) if pipe_read is not None else None
        return ForkedProcess(self, int(reply["pid"]), reader, request=ident)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ exits
    def _exit_code(self, request: int | None) -> int | None:
        """The exit code of the child that fork request ``request`` started; None while it runs."""
        with self._lock:
            self._drain()
            return self._exits.get(request) if request is not None else None

    def _wait_for_news(self, timeout: float) -> None:
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                select.select([sock], [], [], timeout)
        else:
            time.sleep(timeout)

    def _drain(self) -> None:
        """Reads every message that has arrived (without waiting)."""
        while self._sock is not None:
            try:
                ready, _, _ = select.select([self._sock], [], [], 0)
            except (OSError, ValueError):
                ready = []
            if not ready:
                return
            if not self._handle_one():
                return

    def _handle_one(self) -> dict[str, Any] | None:
        assert self._sock is not None
        try:
            message, fds = _recv(self._sock)
        except OSError:
            message, fds = None, []
        for fd in fds:
            os.close(fd)
        if message is None:  # the server is gone, and its replicas with it (PR_SET_PDEATHSIG)
            for request in self._started:
                self._exits.setdefault(request, -signal.SIGKILL)
            self._sock.close()
            self._sock = None
            return None
        if message.get("op") == "started" and "pid" in message:
            self._started[int(message["id"])] = int(message["pid"])
        elif message.get("op") == "exit":
            self._exits[int(message["id"])] = int(message["code"])
        return message

    def _read_until(self, wanted: Any, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while self._sock is not None and time.monotonic() < deadline:
            ready, _, _ = select.select([self._sock], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
            if not ready:
                if self._proc is not None and self._proc.poll() is not None:
                    return None  # it died before answering
                continue
            message = self._handle_one()
            if message is not None and wanted(message):
                return message
        return None


if __name__ == "__main__":
    # The server's process keeps this module's name (``python -m phalanx.launch.forkserver``, as
    # ``ps`` shows it); its loop and a forked child's becoming the program are in
    # phalanx.launch.forkserver_process.
    from phalanx.launch import forkserver_process

    forkserver_process.main()
