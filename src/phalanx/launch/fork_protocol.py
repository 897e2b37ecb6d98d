"""What the fork server and its clients share: messages with descriptors, the inherited
connection's variable, and dying with the parent.

A message is one JSON object per ``SOCK_SEQPACKET`` datagram, with the descriptors it passes
(``SCM_RIGHTS``); :data:`INHERIT_VARIABLE` names a forked program's own connection to the server
it came from. Both sides import this module: :mod:`phalanx.launch.forkserver` (the client, in the
launcher) and :mod:`phalanx.launch.forkserver_process` (the server's process).
"""

from __future__ import annotations

import array
import ctypes
import importlib.util
import json
import os
import re
import signal
import socket
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["INHERIT_VARIABLE", "die_with_parent"]

_MAX_MESSAGE = 1 << 20  # one request (its environment included) fits in a datagram this size
_PR_SET_PDEATHSIG = 1

# Variables a fresh interpreter (or a preloaded module) reads before the program runs: a task
# whose value differs from the server's cannot be forked and is started fresh instead.
# PYTHONUNBUFFERED and OMP_NUM_THREADS are applied by hand (see the module docstring).
_STARTUP = re.compile(
    r"^(PYTHON|LD_|KERAS_|TORCH_|TORCHINDUCTOR_|TORCHDYNAMO_|PYTORCH_|OMP_|MKL_|OPENBLAS_|GOTO_|MALLOC_|TF_CPP_)"
)
# FD:SERVER_PID:OWNER_PID - this process's connection to the server it was forked from
INHERIT_VARIABLE = "PHALANX_FORK_SERVER"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


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
