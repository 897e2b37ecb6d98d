"""The control channel between an interactive main (replica 0) and its replica processes.

Messages are length-prefixed JSON objects: cell sources, results and traceback *texts*. Nothing
is ever unpickled, so a peer can at worst send a string. A forked replica talks over a
``socketpair`` made before the fork (no one else holds it); a spawned replica connects to a
loopback socket and must first present the session's random secret
(:func:`accept_authenticated`), compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import socket
import struct
import threading
import time
from typing import Any, Callable

from phalanx.errors import LaunchError

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 256 << 20  # a replayed notebook history is the largest message


class Channel:
    """One end of a control connection; ``send`` is thread-safe, ``recv`` has one reader."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode()
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None when the peer closed the connection."""
        header = self._read(_HEADER.size)
        if header is None:
            return None
        (size,) = _HEADER.unpack(header)
        if size > MAX_MESSAGE:
            raise LaunchError(
                f"A control message of {size} bytes exceeds the limit of {MAX_MESSAGE}.",
                hint="the peer is not a phalanx replica of this session",
            )
        data = self._read(size)
        if data is None:
            return None
        message = json.loads(data)
        if not isinstance(message, dict):
            raise LaunchError(f"A control message must be a JSON object, got {type(message).__name__}.")
        return message

    def _read(self, size: int) -> bytes | None:
        chunks, left = [], size
        while left:
            try:
                chunk = self.sock.recv(left)
            except (ConnectionError, OSError):
                return None
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def accept_authenticated(
    listener: socket.socket, secret: str, timeout: float, check: Callable[[], None] | None = None
) -> tuple[Channel, int]:
    """Accepts one replica that proves it knows ``secret``; returns its channel and rank.

    ``check`` is called every 0.2 s while waiting; it raises to give up early (a replica died).

    Raises:
        LaunchError: nobody presented the secret within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    listener.settimeout(0.2)
    while True:
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            if check is not None:
                check()
            if time.monotonic() < deadline:
                continue
            raise LaunchError(
                f"No replica connected back within {timeout:.0f} s.",
                hint="see the replicas' logs for the reason they did not start",
            ) from None
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        channel = Channel(sock)
        try:
            hello = channel.recv()
        except (LaunchError, ValueError):
            hello = None
        if (
            hello
            and hello.get("op") == "hello"
            and isinstance(hello.get("secret"), str)
            and hmac.compare_digest(hello["secret"].encode(), secret.encode())
        ):
            sock.settimeout(None)
            return channel, int(hello["rank"])
        channel.close()  # a stranger: drop it and keep waiting
