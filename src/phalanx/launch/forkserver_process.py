"""The fork server's own process: its loop, and how a forked child becomes the program.

:class:`~phalanx.launch.forkserver.ForkServer` (the client side, in the launcher) starts this
module's :func:`main` as ``python -m phalanx.launch.forkserver FD PRELOAD...``: it imports the preloaded
modules once (torch, and Keras for a Keras script), then forks one child per request. A child
becomes the requested program as a fresh ``python`` would (its standard streams, environment,
``sys.argv``, ``sys.path[0]`` and a fresh ``__main__``) and never returns into the loop. See
:mod:`phalanx.launch.forkserver` for the whole mechanism and what it guarantees.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import os
import select
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from phalanx.launch.fork_protocol import _STARTUP, INHERIT_VARIABLE, _installed, _recv, _send, die_with_parent
from phalanx.launch.stdio import flush_quietly, own_streams

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


# The files of the server's own frames above a program's (``python -m phalanx.launch.forkserver``
# runs main() here): an uncaught exception is shown without them.
_SERVER_FILES = frozenset({__file__, os.path.join(os.path.dirname(__file__), "forkserver.py")})


def _report_uncaught(error: BaseException) -> None:
    """Prints an uncaught exception as ``python train.py`` would: without the server's frames."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _SERVER_FILES:
        tb = tb.tb_next
    sys.excepthook(type(error), error.with_traceback(tb), tb)


def main() -> None:
    """The server's process (``python -m phalanx.launch.forkserver FD PRELOAD...``): serves until its
    launcher is gone; in a forked child, runs the requested program and exits as it does."""
    # Started by a process with a closed descriptor: /dev/null there, or the descriptors it
    # receives would land on 0-2 and be closed by the child that takes them (see _become).
    own_streams()
    request = _serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2:])
    if request is None:
        return
    kind = _become(request)
    del sys.modules["__main__"]  # the program's __main__ replaces the server's
    try:
        _run(kind, request)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:  # noqa: BLE001 - an uncaught exception of the program
        _report_uncaught(error)
        sys.exit(1)
