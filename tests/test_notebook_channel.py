"""The control channel of interactive sessions: JSON only, and only peers that know the secret."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from phalanx.errors import LaunchError
from phalanx.launch.channel import MAX_MESSAGE, Channel, accept_authenticated


def test_roundtrip_and_closed_peer():
    a, b = socket.socketpair()
    left, right = Channel(a), Channel(b)
    left.send({"op": "cell", "id": 3, "source": "x = 1\nprint('é')"})
    assert right.recv() == {"op": "cell", "id": 3, "source": "x = 1\nprint('é')"}
    left.close()
    assert right.recv() is None
    right.close()


def test_oversized_or_non_object_messages_are_refused():
    a, b = socket.socketpair()
    a.sendall(struct.pack("!I", MAX_MESSAGE + 1))
    with pytest.raises(LaunchError, match="exceeds the limit"):
        Channel(b).recv()
    a.sendall(struct.pack("!I", 7) + b"[1,2,3]")
    with pytest.raises(LaunchError, match="JSON object"):
        Channel(b).recv()
    a.close()
    b.close()


def test_only_a_peer_with_the_secret_is_accepted():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    peers = []

    def connect(secret, rank):
        s = socket.create_connection(("127.0.0.1", port))
        peers.append(s)
        Channel(s).send({"op": "hello", "rank": rank, "secret": secret})

    stranger = threading.Thread(target=connect, args=("wrong", 7))
    stranger.start()
    stranger.join()
    raw = socket.create_connection(("127.0.0.1", port))  # not even JSON
    raw.sendall(b"\x00\x00\x00\x02{]")
    friend = threading.Thread(target=connect, args=("s3cret", 1))
    friend.start()
    friend.join()
    channel, rank = accept_authenticated(listener, "s3cret", timeout=10)
    assert rank == 1
    channel.close()
    with pytest.raises(LaunchError, match="No replica connected"):
        accept_authenticated(listener, "s3cret", timeout=0.2)
    for s in [*peers, raw, listener]:
        s.close()


def test_start_method_setting(monkeypatch):
    from phalanx.errors import ClusterSpecError
    from phalanx.launch.notebook import start_method

    monkeypatch.delenv("PHALANX_INTERACTIVE_START", raising=False)
    assert start_method() == "fork"  # no CUDA initialised in this process
    monkeypatch.setenv("PHALANX_INTERACTIVE_START", "spawn")
    assert start_method() == "spawn"
    monkeypatch.setenv("PHALANX_INTERACTIVE_START", "thread")
    with pytest.raises(ClusterSpecError, match="thread"):
        start_method()
