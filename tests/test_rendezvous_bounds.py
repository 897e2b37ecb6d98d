"""Rendezvous and addresses (issue 13 case 8): every wait bounded, every address problem typed and named."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from phalanx.cluster.validation import validate_cluster
from phalanx.comm.communicator import GroupSpec
from phalanx.comm.group_communicator import ProcessGroupCommunicator
from phalanx.errors import ClusterSpecError, RendezvousTimeoutError

from conftest import free_ports


class ForeignListener:
    """Another program holding a port: it accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()
        self._thread.join(5)


def _spec(rank: int, port: int, world_size: int = 2, timeout: float = 2.0, bind: str = "127.0.0.1") -> GroupSpec:
    return GroupSpec(
        rank=rank,
        world_size=world_size,
        master_addr="127.0.0.1",
        master_port=port,
        bind_addr=bind,
        names=tuple(f"worker:{i}" for i in range(world_size)),
        timeout=5.0,
        rendezvous_timeout=timeout,
    )


@pytest.fixture
def foreign():
    listener = ForeignListener()
    yield listener
    listener.close()


def test_worker_facing_a_foreign_listener_fails_within_the_rendezvous_timeout(foreign):
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as info:
        ProcessGroupCommunicator(_spec(1, foreign.port, timeout=2.0))
    elapsed = time.monotonic() - start
    print(f"\ntime-to-error foreign listener: typed error after {elapsed:.2f}s (rendezvous timeout 2 s): {info.value}")
    assert elapsed < 2.0 + 1.0  # the timeout, plus a 1 s probe at most
    assert f"127.0.0.1:{foreign.port}" in str(info.value) and "worker:0" in str(info.value)


def test_master_port_taken_is_a_cluster_spec_error_naming_port_and_task(foreign):
    with pytest.raises(ClusterSpecError) as info:
        ProcessGroupCommunicator(_spec(0, foreign.port))
    text = str(info.value)
    assert f"port {foreign.port} is taken" in text and "worker:0" in text


@pytest.mark.parametrize(
    "bind,cause", [("no-such-host.invalid", "does not resolve"), ("192.0.2.77", "is not an address of this host")]
)
def test_bad_task_address_is_a_cluster_spec_error(bind, cause):
    start = time.monotonic()
    with pytest.raises(ClusterSpecError) as info:
        ProcessGroupCommunicator(_spec(1, free_ports(1)[0], bind=bind))
    assert cause in str(info.value) and bind in str(info.value) and "worker:1" in str(info.value)
    assert time.monotonic() - start < 10


def test_ipv4_ipv6_mix_is_refused_at_validation():
    with pytest.raises(ClusterSpecError) as info:
        validate_cluster({"chief": ["127.0.0.1:2222"], "worker": ["[::1]:2223"]}, "chief", 0)
    assert info.value.key == "cluster.worker[0]" and "IPv4" in str(info.value) and "IPv6" in str(info.value)


def test_a_timeout_with_thousands_missing_names_the_first_few_and_the_count():
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as info:
        ProcessGroupCommunicator(_spec(0, free_ports(1)[0], world_size=3000, timeout=1.0))
    text = str(info.value)
    assert time.monotonic() - start < 1.0 + 5.0
    assert "worker:1 (rank 1)" in text and "and 2991 more (2999 tasks missing)" in text and len(text) < 600
    assert len(info.value.missing) == 2999


def test_a_peer_that_published_first_gets_the_mismatch_too_though_rank_0_ends_at_once():
    """Worker 1 (told of a 3-worker job) publishes before rank 0 (told of 2). Rank 0 finds the
    mismatch and its process ends, taking the store along: worker 1 must still fail with the typed
    mismatch, not a lost connection (rank 0 keeps the store up until worker 1 has seen it)."""
    import datetime
    import json

    import torch.distributed as dist

    from phalanx.comm import rendezvous
    from phalanx.errors import ClusterSpecMismatchError

    (port,) = free_ports(1)
    delta = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", port, 2, True, delta, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, delta, wait_for_workers=False)
    client.set("rdzv/1", json.dumps({"fingerprint": {"world_size": 3}, "host": "h", "pid": 1}))  # worker 1 was first
    outcome: dict[str, BaseException] = {}

    def worker_1() -> None:
        time.sleep(0.2)  # rank 0 publishes, compares and raises meanwhile
        try:
            rendezvous.exchange(client, rank=1, world_size=3, fingerprint={"world_size": 3}, timeout=10, name=str)
        except BaseException as e:  # noqa: BLE001 - what it raised is the result
            outcome["worker 1"] = e

    thread = threading.Thread(target=worker_1)
    thread.start()
    with pytest.raises(ClusterSpecMismatchError):
        rendezvous.exchange(server, rank=0, world_size=2, fingerprint={"world_size": 2}, timeout=10, name=str)
    del server  # rank 0's process ends: its store with it
    thread.join(20)
    assert isinstance(outcome.get("worker 1"), ClusterSpecMismatchError), outcome
