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
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import gc
import importlib
import importlib.util
import io
import json
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
from phalanx.launch.stdio import flush_quietly, own_streams

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

_MAX_MESSAGE = 1 << 20  # one request (its environment included) fits in a datagram this size
_READY_TIMEOUT = 300.0  # importing torch and Keras on a loaded 2-core machine took up to 20 s
_PR_SET_PDEATHSIG = 1

# Variables a fresh interpreter (or a preloaded module) reads before the program runs: a task
# whose value differs from the server's cannot be forked and is started fresh instead.
# PYTHONUNBUFFERED and OMP_NUM_THREADS are applied by hand (see the module docstring).
_STARTUP = re.compile(
    r"^(PYTHON|LD_|KERAS_|TORCH_|TORCHINDUCTOR_|TORCHDYNAMO_|PYTORCH_|OMP_|MKL_|OPENBLAS_|GOTO_|MALLOC_|TF_CPP_)"
)
_APPLIED = frozenset({"PYTHONUNBUFFERED", "OMP_NUM_THREADS"})
# Read by torch at each use, not at import (torch/_inductor/runtime/cache_dir_utils.py); torch sets
# it in os.environ at a process's first optimizer step, so a launcher's later tasks carry it.
_READ_LATE = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
# FD:SERVER_PID:OWNER_PID - this process's connection to the server it was forked from
INHERIT_VARIABLE = "PHALANX_FORK_SERVER"
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


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


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


# ----------------------------------------------------------------------------- messages
def _send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) when the peer is gone."""
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(_MAX_MESSAGE, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


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


def die_with_parent(parent: int, *, own_group: bool = False) -> None:
    """Makes this process, a child of ``parent`` just forked, die with it: every child phalanx starts.

    ``PR_SET_PDEATHSIG`` (SIGKILL) from the kernel once the parent's thread that forked it ends,
    and an exit at once if the parent is already gone. ``own_group``: its own process group
    first, so that a Ctrl-C at the terminal reaches the parent alone, which forwards it once.
    Async-signal-safe (``preexec_fn`` of a thread-using parent): the prctl pointer is resolved at
    import, and only system calls run here.
    """
    if own_group:
        os.setpgid(0, 0)
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


try:  # resolved before any fork: children call the function pointer and nothing else
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


# ----------------------------------------------------------------------------- the server
_SIGINT_AT_START = signal.getsignal(signal.SIGINT)  # what the server's parent left it (see _become)


def _serve(sock: socket.socket, preload: Sequence[str]) -> dict[str, Any] | None:
    """The server's loop. Returns a fork request in a forked child; None in the server when its
    launcher is gone (the server then ends, and its remaining children with it).

    ``sock`` is the launcher's connection; every forked child gets one more (see
    :func:`inherited_server`). A child's exit is reported on the connection that asked for it; the
    children of a connection that closes are killed.
    """
    loaded = []
    for name in preload:
        if name == "keras" and not _cpu_only_torch():
            continue  # Keras asks torch for CUDA devices at import: never before a fork
        pinned = name == "keras" and "KERAS_BACKEND" not in os.environ
        if pinned:  # the script sets it before importing Keras (preload_for checked): do the same
            os.environ["KERAS_BACKEND"] = "torch"
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as e:  # noqa: BLE001 - the replica imports it itself, and reports
            print(f"phalanx: fork server: could not preload {name}: {e}", file=sys.stderr)
        finally:
            if pinned:  # the server's environment stays the launcher's (see forkable)
                del os.environ["KERAS_BACKEND"]
    flush_quietly()  # a stderr whose reader went away must not end the server
    # What the preloaded modules made is never collected: keep the collector of every child off
    # it, or its first collection writes to (and so copies) nearly every page of that heap.
    gc.collect()
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor forwards signals to each replica
    hello = {
        "pid": os.getpid(),
        "preloaded": loaded,
        "env": {k: v for k, v in os.environ.items() if _STARTUP.match(k)},  # what forkable() compares
    }
    _send(sock, {"op": "ready", **hello})
    clients = [sock]
    # A running child -> the connection that asked for it, and the id of its request (an exit is
    # reported by that id: the client never confuses it with a later child given the same pid).
    owners: dict[int, tuple[socket.socket, int]] = {}
    while True:
        ready, _, _ = select.select([*clients, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(owners)
        for client in [c for c in clients if c in ready]:
            try:
                request, fds = _recv(client)
            except OSError:
                request, fds = None, []
            if request is None:
                if client is sock:
                    return None
                _disconnect(client, clients, owners)
                continue
            if request.get("op") == "hello":
                with contextlib.suppress(OSError):  # a connection already closed: seen at the next select
                    _send(client, {"op": "hello", **hello})
                continue
            request["_server"] = os.getpid()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                os.close(wake_r)
                os.close(wake_w)
                for other in clients:
                    other.close()
                ours.close()
                request["_fds"], request["_connection"] = fds, theirs
                return request
            theirs.close()
            for fd in fds:
                os.close(fd)
            clients.append(ours)
            owners[pid] = (client, request["id"])
            with contextlib.suppress(OSError):
                _send(client, {"op": "started", "id": request["id"], "pid": pid})


def _disconnect(
    client: socket.socket, clients: list[socket.socket], owners: dict[int, tuple[socket.socket, int]]
) -> None:
    """A child's connection closed (it ended, or was killed): its own children die with it."""
    clients.remove(client)
    client.close()
    for pid, (owner, _) in list(owners.items()):
        if owner is client:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _reap(owners: dict[int, tuple[socket.socket, int]]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        owner, request = owners.pop(pid, (None, None))
        if owner is not None and owner.fileno() != -1:
            with contextlib.suppress(OSError):
                code = os.waitstatus_to_exitcode(status)
                _send(owner, {"op": "exit", "id": request, "pid": pid, "code": code})


def _cpu_only_torch() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return _installed("torch") is False
    return getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None


_KEEP: list[Any] = []  # the server's standard streams: never closed (collected) in a child


def _become(request: dict[str, Any]) -> str:
    """In a forked child: the process of ``request``. Returns how to run it (see :func:`_run`)."""
    server = request["_server"]  # not getppid(): the server may already be gone
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # As a fresh interpreter: Ctrl-C raises KeyboardInterrupt, unless SIGINT came in ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN if _SIGINT_AT_START == signal.SIG_IGN else signal.default_int_handler)
    if request["new_session"]:
        os.setsid()
    die_with_parent(server, own_group=request["own_group"] and not request["new_session"])
    fds, names = request["_fds"], request["fds"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if "stdout" in names:
        os.dup2(fds[names["stdout"]], 1)
    if "stderr" in names:
        os.dup2(fds[names["stderr"]], 2)
    elif request["stderr_to_stdout"]:
        os.dup2(1, 2)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(request["env"])
    connection = request["_connection"]
    _KEEP.append(connection)  # open for the program's life (close-on-exec: a program it execs has none)
    os.environ[INHERIT_VARIABLE] = f"{connection.fileno()}:{server}:{os.getpid()}"
    _standard_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads != before.get("OMP_NUM_THREADS") and threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if "numpy.random" in sys.modules:  # a fresh process draws its own entropy
        sys.modules["numpy.random"].seed()
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path[0] = os.getcwd()
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    return argv[0]


def _standard_streams(unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr over descriptors 0-2, as the interpreter builds them at start."""
    _KEEP.extend([sys.stdin, sys.stdout, sys.stderr])
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    errors = getattr(sys.stdout, "errors", None) or "strict"

    def writer(fd: int, error: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        tty = raw.isatty()
        buffer = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buffer,  # type: ignore[arg-type]
            encoding=encoding,
            errors="backslashreplace" if error else errors,
            line_buffering=error or tty,
            write_through=unbuffered,
        )

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    sys.stdout = sys.__stdout__ = writer(1, False)
    sys.stderr = sys.__stderr__ = writer(2, True)


def _run(kind: str, request: dict[str, Any]) -> None:
    """Runs the program of a forked child in a fresh ``__main__`` (as the interpreter would)."""
    import builtins
    import types

    from phalanx._compat.python import run_module_as_main

    argv = request["argv"]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    if kind == "-m":
        run_module_as_main(argv[1])
        return
    if kind == "-c":
        source, filename = argv[1], "<string>"
    else:
        filename = os.path.abspath(argv[0])
        with open(filename, "rb") as f:
            source = f.read()
        main.__file__ = filename
        main.__cached__ = None
    exec(compile(source, filename, "exec", dont_inherit=True), main.__dict__)


def _report_uncaught(error: BaseException) -> None:
    """Prints an uncaught exception as ``python train.py`` would: without the server's frames."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    sys.excepthook(type(error), error.with_traceback(tb), tb)


if __name__ == "__main__":
    # Started by a process with a closed descriptor: /dev/null there, or the descriptors it
    # receives would land on 0-2 and be closed by the child that takes them (see _become).
    own_streams()
    _request = _serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2:])
    if _request is not None:
        _kind = _become(_request)
        del sys.modules[__name__]  # the program's __main__ replaces this module
        try:
            _run(_kind, _request)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as _error:  # noqa: BLE001 - an uncaught exception of the program
            _report_uncaught(_error)
            sys.exit(1)
