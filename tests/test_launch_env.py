"""launch/env.py's free_port: a port that no outgoing connection on the host can take before its bind.

A port from bind(0) comes from the kernel's ephemeral range, the range every outgoing TCP
connection on the host takes its local port from; between the pick and the launcher's task
binding it, another connection (a gloo or TCPStore client of a concurrent job) could take it
(``tests/test_root_cause.py``'s ``[ps-ps:0]`` failed once with address-in-use).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from phalanx.launch import env
from phalanx.launch.env import free_port

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _kernel_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        pytest.skip(f"{RANGE_FILE} is not readable here (not Linux?)")
    if low - 1025 < 1000 and 65535 - high < 1000:
        pytest.skip(f"the kernel's ephemeral range {low}-{high} leaves no room for free_port outside it")
    return low, high


def _use_range_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    monkeypatch.setattr(env, "_EPHEMERAL_PORT_RANGE_FILE", str(path))


def test_free_port_is_outside_the_kernels_ephemeral_range_and_bindable() -> None:
    low, high = _kernel_range()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high, f"{port} is in the ephemeral range {low}-{high}"
        assert 1024 < port <= 65535
        assert _bindable(port)


def test_free_port_above_the_range_when_there_is_no_room_below(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _use_range_file(monkeypatch, tmp_path, "1500\t60000\n")
    for _ in range(20):
        port = free_port()
        assert 60000 < port <= 65535
        assert _bindable(port)


@pytest.mark.parametrize("text", ["1024\t65535\n", "1800\t64800\n", "not a range\n", None])
def test_free_port_falls_back_to_the_kernels_pick(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str | None
) -> None:
    # No room of 1000 ports on either side of the range (or no range to read): bind(0) picks it.
    if text is None:
        monkeypatch.setattr(env, "_EPHEMERAL_PORT_RANGE_FILE", str(tmp_path / "missing"))
    else:
        _use_range_file(monkeypatch, tmp_path, text)
    ports = [free_port() for _ in range(20)]
    assert all(1024 < p <= 65535 and _bindable(p) for p in ports)
    assert len(set(ports)) == len(ports)


def test_free_port_returns_distinct_ports_in_a_row() -> None:
    # ps/cluster_launcher picks the ports of all its tasks before any of them binds one.
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_free_port_skips_a_port_that_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # Two candidates, one of them held by another program: free_port never hands that one out.
        monkeypatch.setattr(env, "_ports_outside_ephemeral_range", lambda: range(taken, taken + 2))
        port = free_port()
        assert port != taken
        assert _bindable(port)
