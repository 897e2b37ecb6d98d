"""How the processes of a job find each other: the store, and the handshake that compares their specs.

Rank 0 listens on the master address (on the task's own address, never on every interface) and
serves a ``torch.distributed.TCPStore``; every rank publishes its fingerprint (world size, master,
the cluster spec's digest, ...) and checks everyone else's with
:func:`phalanx.cluster.placement.compare_fingerprints`, the function the cluster tests test.

Every wait here is bounded by the rendezvous timeout, whatever the peer at the other end does: a
foreign program that holds the master port and accepts connections without answering makes
torch's store client block forever in its handshake, so the client is connected on a helper
thread and given up on at the deadline (the thread is blocked in a socket read with the GIL
released, and ends with the process).

Address problems are :class:`~phalanx.errors.ClusterSpecError` naming the task, the address and
the cause: does not resolve, not an address of this host, port taken by another program.

A task still waiting some seconds into the rendezvous (``PHALANX_RENDEZVOUS_NOTICE``, 5 s) says
once, on stderr, whom it waits for and how long it will: a peer that never comes would otherwise
mean minutes of silence before the timeout's error (:class:`WaitNotice`).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from phalanx._signal_routing import helper_threads_ignore_stop_signals
from phalanx.cluster.placement import compare_fingerprints
from phalanx.errors import ClusterSpecError, ClusterSpecMismatchError, RendezvousTimeoutError


def host_id() -> str:
    """What makes two processes "the same host" (shared memory, /proc): the hostname.

    ``PHALANX_HOST_ID`` overrides it, so tests can make processes of one machine act as hosts.
    """
    return os.environ.get("PHALANX_HOST_ID") or socket.gethostname()


class WaitNotice:
    """Says once, on stderr, which tasks a rendezvous is still waiting for, ``after`` seconds in.

    One notice serves every phase of a process's rendezvous (the store, then the peers), so the
    line comes once however many phases wait. ``after=None`` keeps it quiet.

    Example:
        >>> quiet, due = WaitNotice(after=None), WaitNotice(after=0.0)
        >>> for notice in (quiet, due):  # the due one prints its line on stderr
        ...     notice.poll(lambda: ["worker:1 (rank 1) at 10.0.0.2:2222"], deadline=time.monotonic() + 60)
        >>> quiet.given, due.given, due.due_in()
        (False, True, None)
    """

    def __init__(self, after: float | None) -> None:
        self.after = after
        self.start = time.monotonic()
        self.given = False

    def due_in(self) -> float | None:
        """Seconds until the notice is due (0 when it is), or None when it will not come."""
        if self.after is None or self.given:
            return None
        return max(0.0, self.start + self.after - time.monotonic())

    def poll(self, missing: Callable[[], list[str]], deadline: float) -> None:
        """Prints the notice if it is due: ``missing()`` names the tasks not yet arrived (with their
        addresses where known), ``deadline`` is when this wait ends (``time.monotonic()``)."""
        if self.due_in() != 0.0:
            return
        self.given = True
        names = missing()
        if not names:
            return
        named = ", ".join(names[: RendezvousTimeoutError.NAMED])
        if len(names) > RendezvousTimeoutError.NAMED:
            named += f" and {len(names) - RendezvousTimeoutError.NAMED} more ({len(names)} tasks)"
        left = max(0.0, deadline - time.monotonic())
        print(
            f"phalanx: waiting for {named}; {left:.0f} s left before RendezvousTimeoutError",
            file=sys.stderr,
            flush=True,
        )


def _address_error(task: str, host: str, port: int, err: OSError) -> ClusterSpecError:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(err, socket.gaierror):
        return ClusterSpecError(
            task,
            address,
            f"the host {host!r} does not resolve ({err.strerror or err})",
            hint="use a hostname or IP that every task can resolve",
        )
    if err.errno == errno.EADDRINUSE:
        return ClusterSpecError(
            task,
            address,
            f"port {port} is taken by another program on this host",
            hint="stop that program, or give this task another port (port 0 in tests)",
        )
    if err.errno == errno.EADDRNOTAVAIL:
        return ClusterSpecError(
            task,
            address,
            f"{host!r} is not an address of this host",
            hint="each task's address must be one of its own host's addresses; the task "
            "index may be wrong for this machine",
        )
    if err.errno in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
        return ClusterSpecError(
            task,
            address,
            f"this host has no {'IPv6' if ':' in host else 'IPv4'} support",
            hint="use addresses of one family (all IPv4 or all IPv6)",
        )
    return ClusterSpecError(task, address, f"cannot listen there: {err}", hint="check the address and port")


def _resolve(host: str, port: int, task: str) -> tuple[int, Any]:
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise _address_error(
            task, host, port, e if isinstance(e, socket.gaierror) else socket.gaierror(str(e))
        ) from None
    return family, sockaddr


def listen_socket(host: str, port: int, task: str = "task") -> socket.socket:
    """A listening socket on ``host:port`` for the store's server.

    torch's TCPStore binds its server to every interface whatever host it is given; handing it a
    socket we bound ourselves keeps the listener on the task's own address.

    Raises:
        ClusterSpecError: ``host`` does not resolve, is not an address of this host, or the port
            is taken.
    """
    family, sockaddr = _resolve(host, port, task)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise _address_error(task, host, port, e) from None
    return sock


def check_bind_address(host: str, task: str = "task") -> None:
    """Raises a ClusterSpecError if this process cannot listen on ``host`` (any free port)."""
    listen_socket(host, 0, task).close()


def connect_store(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    bind_addr: str,
    timeout: float,
    master_task: str,
    task: str,
    notice: WaitNotice | None = None,
) -> dist.TCPStore:
    """Rank 0 serves the store on the master address; the others connect, within ``timeout``.

    ``notice`` names the master task (with its address) once the connection has taken that long.

    Raises:
        ClusterSpecError: rank 0 cannot listen on the master address (see :func:`listen_socket`).
        RendezvousTimeoutError: no store answered at the master address within ``timeout``
            (nobody listening, or another program holding the port); names the port and task.
    """
    delta = datetime.timedelta(seconds=timeout)
    if rank == 0:
        sock = listen_socket(bind_addr or master_addr, master_port, task)
        with helper_threads_ignore_stop_signals():  # the store's server thread: a Ctrl-C is for the main one
            return dist.TCPStore(
                master_addr,
                master_port,
                world_size,
                True,
                delta,
                wait_for_workers=False,
                master_listen_fd=sock.detach(),
            )
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(master_addr, master_port, world_size, False, delta, wait_for_workers=False)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e

    helper = threading.Thread(target=connect, name="phalanx-store-connect", daemon=True)
    with helper_threads_ignore_stop_signals():  # and so the client's native threads it starts
        helper.start()
    deadline = time.monotonic() + timeout
    where = f"{master_task} at {master_addr}:{master_port}"
    due = notice.due_in() if notice is not None else None
    if due is not None and due < timeout:
        helper.join(due)
        if helper.is_alive():
            notice.poll(lambda: [where], deadline)
    helper.join(max(0.0, deadline - time.monotonic()))
    if "store" in box:
        return box["store"]
    error = box.get("error")
    if error is None and _accepts(master_addr, master_port):
        cause = (
            f"port {master_port} accepts connections but never answered as a phalanx rendezvous store "
            "(another program holds it?)"
        )
    else:
        first = str(error).strip().splitlines()[0][:200] if error is not None and str(error).strip() else ""
        cause = f"nothing answered at port {master_port}" + (f" ({first})" if first else "")
    raise RendezvousTimeoutError([where], timeout, cause=cause) from error


MISMATCH_LINGER_S = 3.0  # rank 0 keeps the store up this long at most for peers to see the mismatch


def _linger_for_peers(store: Any, rank: int, world_size: int) -> None:
    """A mismatch was found. Rank 0 hosts the store: before it raises (and the store goes with its
    process), the peers that published get up to :data:`MISMATCH_LINGER_S` to read its fingerprint
    and fail with the same typed error, rather than with a lost connection."""
    try:
        store.set(f"rdzv/failed/{rank}", "1")
        if rank != 0:
            return
        end = time.monotonic() + MISMATCH_LINGER_S
        # every rank that published (including one beyond our world) has seen the mismatch, or time is up
        while time.monotonic() < end:
            published = [r for r in range(1, world_size + 1) if store.check([f"rdzv/{r}"])]
            if all(store.check([f"rdzv/failed/{r}"]) for r in published):
                return
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - the mismatch is the error to report, not the store
        return


def _accepts(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (a quick probe, 1 s at most)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _located(label: str, rank: int, address: Callable[[int], str] | None) -> str:
    where = address(rank) if address is not None else ""
    return f"{label} at {where}" if where else label


def exchange(
    store: Any,
    *,
    rank: int,
    world_size: int,
    fingerprint: dict[str, Any],
    timeout: float,
    name: Any,
    check: Callable[[], None] | None = None,
    notice: WaitNotice | None = None,
    address: Callable[[int], str] | None = None,
) -> dict[int, dict[str, Any]]:
    """Publishes this rank's fingerprint, waits for everyone's and compares them.

    ``check``, if given, is called while waiting; it raises when the launcher knows a peer that
    has not arrived is dead (its error then ends the wait, not the timeout).

    ``notice`` names the ranks not yet arrived once the wait has taken that long, each followed by
    ``" at " + address(rank)`` where ``address`` knows it (a cluster spec's task address).

    Returns:
        rank -> ``{"fingerprint", "host", "pid"}`` for every rank.

    Raises:
        ClusterSpecMismatchError: a peer's fingerprint differs (the first differing field).
        RendezvousTimeoutError: not every rank published within ``timeout``; names the first few
            missing ranks and how many are missing.
    """
    me = {"fingerprint": fingerprint, "host": host_id(), "pid": os.getpid()}
    store.set(f"rdzv/{rank}", json.dumps(me, sort_keys=True, default=str))
    deadline = time.monotonic() + timeout
    peers: dict[int, dict[str, Any]] = {rank: me}
    while True:
        missing = [r for r in range(world_size) if r not in peers]
        arrived = [r for r in missing if store.check([f"rdzv/{r}"])]
        try:
            for r in arrived:
                peers[r] = json.loads(store.get(f"rdzv/{r}"))
                compare_fingerprints(fingerprint, peers[r]["fingerprint"], name(r))
            # A peer that believes in a larger world publishes a rank we do not expect.
            if store.check([f"rdzv/{world_size}"]):
                extra = json.loads(store.get(f"rdzv/{world_size}"))
                raise ClusterSpecMismatchError(
                    "world_size", world_size, extra["fingerprint"].get("world_size"), f"rank {world_size}"
                )
        except ClusterSpecMismatchError:
            _linger_for_peers(store, rank, world_size)
            raise
        if len(peers) == world_size:
            return peers
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError([name(r) for r in range(world_size) if r not in peers], timeout)
        if notice is not None:
            notice.poll(lambda late=missing: [_located(name(r), r, address) for r in late if r not in peers], deadline)
        time.sleep(0.01)
