"""How the processes of a job find each other: the store, and the handshake that compares their specs.

Rank 0 listens on the master address (on the task's own address, never on every interface) and
serves a ``torch.distributed.TCPStore``; every rank publishes its fingerprint (world size, master,
the cluster spec's digest, ...) and checks everyone else's with
:func:`phalanx.cluster.placement.compare_fingerprints`, the function the cluster tests test.

Every wait here is bounded by the rendezvous timeout, whatever the peer at the other end does: a
foreign program that holds the master port and accepts connections without answering makes
torch's store client block forever in its handshake, so the client is connected on a helper
thread and given up on at the deadline (the thread is blocked in a socket read with the GIL
released, and ends with the process). Before that client exists, a plain TCP connect loop waits
for something to listen at the master's address (:class:`_Probe`): a master that never comes, a
port nobody serves or a host that does not resolve then ends in phalanx's typed error alone,
never after torch's C++ stack trace for the same failure (set ``TORCH_CPP_LOG_LEVEL`` to see
torch's own account of the connection instead).

Address problems are :class:`~phalanx.errors.ClusterSpecError` naming the task, the address and
the cause: does not resolve, not an address of this host, port taken by another program.

A task still waiting some seconds into the rendezvous (``PHALANX_RENDEZVOUS_NOTICE``, 5 s) says
once, on stderr, whom it waits for and how long it will: a peer that never comes would otherwise
mean minutes of silence before the timeout's error (:class:`WaitNotice`). Peers that a launcher
started with this process (``python train.py``'s own replicas, ``phalanx run``, torchrun: no
cluster spec lists their addresses) run the same program and take about as long to arrive as this
one took to get here (importing torch and Keras took up to 10 s on a busy 2-core machine, and a
self-launched replica starts only when replica 0 has arrived): they are named only once they are
late against that, as still starting.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from phalanx import config
from phalanx._compat import torch as compat_torch
from phalanx._signal_routing import helper_threads_ignore_stop_signals
from phalanx.cluster.placement import compare_fingerprints
from phalanx.errors import ClusterSpecError, ClusterSpecMismatchError, RendezvousTimeoutError


def host_id() -> str:
    """What makes two processes "the same host" (shared memory, /proc): the hostname.

    ``PHALANX_HOST_ID`` (the setting ``host_id``) overrides it, so tests can make processes of one
    machine act as hosts.
    """
    return config.settings().host_id or socket.gethostname()


# A launcher's peer is late once it has taken twice as long as this process took to start, but
# never waited for silently longer than this.
LATE_FACTOR = 2.0
LATE_CAP_S = 60.0


def process_age() -> float:
    """Seconds since this process started (since its fork, for a forked one); 0.0 where /proc
    cannot say. What a fresh replica of the same program will take, about, to get this far."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class WaitNotice:
    """Says once, on stderr, which tasks a rendezvous is still waiting for, ``after`` seconds in.

    One notice serves every phase of a process's rendezvous (the store, then the peers), so the
    line comes once however many phases wait. ``after=None`` keeps it quiet.

    ``started_in``: how long this process took to reach the rendezvous, when the peers are its
    launcher's (they run the same program, started with it or by it). The notice then waits until
    they are late against that (:data:`LATE_FACTOR` times it, at most :data:`LATE_CAP_S`, at least
    ``after``) and says they are still starting: a healthy job whose replicas import slowly prints
    nothing, and none is told it will be given up on.

    Example:
        >>> quiet, due = WaitNotice(after=None), WaitNotice(after=0.0)
        >>> for notice in (quiet, due):  # the due one prints its line on stderr
        ...     notice.poll(lambda: ["worker:1 (rank 1) at 10.0.0.2:2222"], deadline=time.monotonic() + 60)
        >>> quiet.given, due.given, due.due_in()
        (False, True, None)
        >>> slow_start = WaitNotice(after=5.0, started_in=9.0)  # this process took 9 s to get here
        >>> 17.0 < slow_start.due_in() <= 18.0  # its peers are late after 18 s, not 5
        True
    """

    def __init__(self, after: float | None, *, started_in: float | None = None) -> None:
        self.after = after
        self.started_in = started_in
        if after is not None and started_in is not None:
            self.after = max(after, min(LATE_FACTOR * started_in, LATE_CAP_S))
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
        # No error's name in it: the job may well succeed, and log watchers flag "Error" lines.
        if self.started_in is not None:
            waited = time.monotonic() - self.start
            line = (
                f"phalanx: {named} {'is' if len(names) == 1 else 'are'} still starting: not here after "
                f"{waited:.0f} s, where this process took {self.started_in:.1f} s to start; waiting up to "
                f"{left:.0f} s more (PHALANX_RENDEZVOUS_TIMEOUT)"
            )
        else:
            line = f"phalanx: waiting for {named}; giving up in {left:.0f} s (PHALANX_RENDEZVOUS_TIMEOUT)"
        print(line, file=sys.stderr, flush=True)


def _address_error(task: str, host: str, port: int | None, err: OSError) -> ClusterSpecError:
    """The error for an address this task cannot listen on; ``port`` None: the host alone is named."""
    address = host if port is None else f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
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


def _resolve(host: str, port: int, task: str, shown: int | None) -> tuple[int, Any]:
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise _address_error(
            task, host, shown, e if isinstance(e, socket.gaierror) else socket.gaierror(str(e))
        ) from None
    return family, sockaddr


def listen_socket(host: str, port: int, task: str = "task", *, configured: int | None = -1) -> socket.socket:
    """A listening socket on ``host:port`` for the store's server.

    torch's TCPStore binds its server to every interface whatever host it is given; handing it a
    socket we bound ourselves keeps the listener on the task's own address.

    Args:
        configured: the port an error names (default ``port``; None: none). A probe on port 0
            names the port the user configured, not the 0 it asked the kernel for.

    Raises:
        ClusterSpecError: ``host`` does not resolve, is not an address of this host, or the port
            is taken.
    """
    shown = port if configured == -1 else configured
    family, sockaddr = _resolve(host, port, task, shown)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise _address_error(task, host, shown, e) from None
    return sock


def check_bind_address(host: str, task: str = "task", address: str = "") -> None:
    """Raises a ClusterSpecError if this process cannot listen on ``host`` (any free port).

    ``address``: the task's ``host:port`` as configured (a cluster spec's), whose port the error
    names; without it the error names the host alone.
    """
    port = address.rsplit(":", 1)[1] if ":" in address else ""
    listen_socket(host, 0, task, configured=int(port) if port.isdigit() else None).close()


# The keys phalanx writes into a store it shares with someone else (torchrun's agent, the store of
# the default group an engine made) live under this prefix.
JOINED_PREFIX = "phalanx/"
# Backends of a default group phalanx may join: gloo, NCCL, or both by device ("cpu:gloo,cuda:nccl").
JOINABLE_BACKENDS = frozenset(("gloo", "nccl"))


def _same_host(a: str, b: str) -> bool:
    """Whether two host names or addresses name the same host (as written, or resolved)."""
    if a == b:
        return True

    def addresses(host: str) -> set[str]:
        try:
            return {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            return set()

    return bool(addresses(a) & addresses(b))


def check_joinable_backend(backend: str, gpus: int) -> None:
    """Raises unless a strategy can run on a default group of ``backend`` with ``gpus`` visible GPUs.

    phalanx builds its own gloo and NCCL groups; a default group on another backend (MPI, an
    accelerator's: ``hccl``, ``xla``) means devices phalanx does not drive, and an NCCL one with no
    GPU means the engine was told the workers have GPUs that this one does not see: training would
    silently run on CPUs.

    Raises:
        ClusterSpecError: naming the backend.

    Example:
        >>> check_joinable_backend("cpu:gloo,cuda:nccl", gpus=1)
        >>> check_joinable_backend("mpi", gpus=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        phalanx.errors.ClusterSpecError: ...torch.distributed backend='mpi'...
    """
    parts = [part.split(":")[-1].strip().lower() for part in backend.split(",") if part.strip()]
    unknown = sorted(set(parts) - JOINABLE_BACKENDS)
    if unknown or not parts:
        raise ClusterSpecError(
            "torch.distributed backend",
            backend,
            f"the job's process group runs on {', '.join(unknown) or 'no backend'}, which phalanx's strategies "
            "cannot use (they run on gloo for CPUs and NCCL for GPUs)",
            hint="make the group with backend 'gloo' (CPU workers) or 'nccl' (GPU workers); under Ray Train: "
            "TorchTrainer(..., torch_config=TorchConfig(backend='gloo'))",
        )
    if "nccl" in parts and "gloo" not in parts and gpus == 0:
        raise ClusterSpecError(
            "torch.distributed backend",
            backend,
            "the job's process group runs on NCCL, but this process sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
            hint="give each worker a GPU (Ray Train: ScalingConfig(use_gpu=True)), or use backend 'gloo' on CPU "
            "workers (TorchConfig(backend='gloo'))",
        )


def default_group_store(master_addr: str, master_port: int, rank: int, world_size: int) -> Any | None:
    """The store of torch's default process group, when that group is this job's rendezvous.

    An engine that made the group before the program ran (Ray Train's ``TorchTrainer``), or a
    program that called ``init_process_group`` first, serves its store at ``MASTER_ADDR:MASTER_PORT``;
    listening there again would fail (the port is taken). phalanx joins that store instead, its keys
    under :data:`JOINED_PREFIX`, and builds its own groups from it. None when there is no default
    group, or when it met elsewhere (then this job's rendezvous is phalanx's own).

    Raises:
        ClusterSpecError: the default group met at this job's address but this process's rank or
            the world size differ from the job's, or its backend is one no strategy can use.
    """
    if not dist.is_initialized():
        return None
    found = compat_torch.default_store_address()
    if found is not None and (found[1] != master_port or not _same_host(found[0], master_addr)):
        return None  # it met elsewhere: not this job's rendezvous
    same_job = (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
    if found is None and not same_job:
        return None  # torch does not say where it met (not a TCP store), and it is not this job's layout
    if not same_job:
        raise ClusterSpecError(
            "torch.distributed default group",
            f"rank {dist.get_rank()} of {dist.get_world_size()}",
            f"it met at {master_addr}:{master_port}, where this strategy's replica is rank {rank} of {world_size}",
            hint="give the strategy the same processes as the default group, or call dist.destroy_process_group() "
            "first",
        )
    import torch

    # A group of this job's layout whose store torch does not show (a backend registered from
    # Python wraps it) is still the engine's: its backend is checked before phalanx builds on it.
    check_joinable_backend(str(dist.get_backend()), torch.cuda.device_count())
    if found is None:
        return None
    return compat_torch.default_group_store()


def joined_prefix(master_addr: str, master_port: int) -> str:
    """The prefix of phalanx's keys in the job's store at ``master_addr:master_port`` ("" when the
    store is phalanx's own): what a fresh client of that store (a diagnosis) must read under."""
    found = compat_torch.default_store_address()
    if _agent_serves(master_addr, master_port) or (
        found is not None and found[1] == master_port and _same_host(found[0], master_addr)
    ):
        return JOINED_PREFIX
    return ""


def _agent_serves(master_addr: str, master_port: int) -> bool:
    """Whether torchrun's agent serves the store this job's master address names
    (``TORCHELASTIC_USE_AGENT_STORE``, set by torchrun for its workers since torch 1.9).

    The address is compared as a host, not as text: across nodes torchrun's ``MASTER_ADDR`` is node
    0's name (Kubeflow Trainer's ``<job>-node-0-0.<job>``), which phalanx has resolved by now.
    """
    env = os.environ
    if config.settings().launcher_store:  # phalanx run serves an elastic job's store (launch/store_host.py)
        return True
    return (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and env.get("MASTER_PORT") == str(master_port)
        and _same_host(env.get("MASTER_ADDR", ""), master_addr)
    )


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

    Where torch's default group already met at the master address (Ray Train made it before the
    program ran), every rank joins its store instead (:func:`default_group_store`): no second
    rendezvous on a port that is taken.

    ``notice`` names the master task (with its address) once the connection has taken that long.

    Raises:
        ClusterSpecError: rank 0 cannot listen on the master address (see :func:`listen_socket`).
        RendezvousTimeoutError: no store answered at the master address within ``timeout``
            (nobody listening, or another program holding the port); names the port and task.
    """
    delta = datetime.timedelta(seconds=timeout)
    # An engine's default group met at this address already (Ray Train): its store is the job's.
    joined = default_group_store(master_addr, master_port, rank, world_size)
    if joined is not None:
        return dist.PrefixStore(JOINED_PREFIX, joined)
    # torchrun's agent may already serve a store at MASTER_ADDR:MASTER_PORT (as for torch's own
    # env:// groups): then rank 0 connects to it like the others, and phalanx's keys get a prefix
    # of their own beside the agent's.
    agent = _agent_serves(master_addr, master_port)
    wrap: Callable[[Any], Any] = (
        (lambda store: dist.PrefixStore(JOINED_PREFIX, store)) if agent else (lambda store: store)
    )
    if rank == 0 and not agent:
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
    deadline = time.monotonic() + timeout
    where = f"{master_task} at {master_addr}:{master_port}"
    probe = _Probe(master_addr, master_port, deadline, quiet=not _torch_logs_asked())
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            if not probe.wait_for_listener():
                return
            # The client's own timeout lies past ours: when it expires, torch logs a C++ stack
            # trace. Past ours, phalanx has already reported the failure (and the program most
            # likely ended); the store gets the job's timeout back once connected.
            client_timeout = delta + _CLIENT_GRACE if probe.quiet else delta
            store = dist.TCPStore(master_addr, master_port, world_size, False, client_timeout, wait_for_workers=False)
            store.set_timeout(delta)
            box["store"] = store
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e

    helper = threading.Thread(target=connect, name="phalanx-store-connect", daemon=True)
    with helper_threads_ignore_stop_signals():  # and so the client's native threads it starts
        helper.start()
    due = notice.due_in() if notice is not None else None
    if due is not None and due < timeout:
        helper.join(due)
        if helper.is_alive():
            notice.poll(lambda: [where], deadline)
    helper.join(max(0.0, deadline - time.monotonic()))
    if not probe.quiet:  # the user asked for torch's logs: its client's last lines come first
        helper.join(_LOGS_GRACE_S)
    if "store" in box:
        return wrap(box["store"])
    error = box.get("error")
    if isinstance(probe.last_error, socket.gaierror) or (probe.last_error is None and _unresolvable(master_addr)):
        reason = probe.last_error or socket.gaierror("no address")
        cause = f"the host {master_addr!r} does not resolve ({getattr(reason, 'strerror', None) or reason})"
    elif probe.not_a_store:
        cause = f"port {master_port} {probe.not_a_store}: not a phalanx rendezvous store (another program holds it?)"
    elif error is None and probe.accepted and _accepts(master_addr, master_port):
        cause = (
            f"port {master_port} accepts connections but never answered as a phalanx rendezvous store "
            "(another program holds it?)"
        )
    else:
        seen = error if error is not None else probe.last_error
        first = str(seen).strip().splitlines()[0][:200] if seen is not None and str(seen).strip() else ""
        cause = f"nothing answered at port {master_port}" + (f" ({first})" if first else "")
    raise RendezvousTimeoutError([where], timeout, cause=cause) from error


# The store client's own connection timeout runs this long past phalanx's (see connect_store).
_CLIENT_GRACE = datetime.timedelta(hours=1)
_LOGS_GRACE_S = 2.0  # with TORCH_CPP_LOG_LEVEL set: how long torch's client may take to log its end
_SPEAKS_FIRST_S = 0.05  # a store's server never writes before the client asks: a program that does is not one


def _torch_logs_asked() -> bool:
    """Whether the user set torch's C++ log level: then torch's client is left to log as it does."""
    return bool(os.environ.get("TORCH_CPP_LOG_LEVEL", "").strip())


class _Probe:
    """Waits, in Python, until something listens at the master's address before torch's store
    client is created.

    torch's client retries quietly while nothing listens, but when its own timeout expires (or a
    connection is reset) it writes a 30-line C++ stack trace to stderr, racing phalanx's typed
    error for the same failure. A plain TCP connect loop finds out the same things (the host does
    not resolve; nothing listens; something listens but closes the connection or speaks first),
    quietly, and keeps what it saw for the error's message. ``quiet=False`` (the user set
    ``TORCH_CPP_LOG_LEVEL``) skips it, so that torch logs the whole connection as it does.
    """

    def __init__(self, host: str, port: int, deadline: float, *, quiet: bool) -> None:
        self.host, self.port, self.deadline, self.quiet = host, port, deadline, quiet
        self.last_error: BaseException | None = None
        self.not_a_store = ""  # what the program at the port did, when it is not a store
        self.accepted = not quiet

    def wait_for_listener(self) -> bool:
        """True once a connection was accepted (and not refused at once); False at the deadline."""
        if not self.quiet:
            return True
        while True:
            if self._try():
                self.accepted = True
                return True
            left = self.deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.1, left))

    def _try(self) -> bool:
        left = max(0.05, self.deadline - time.monotonic())
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            self.last_error = e if isinstance(e, socket.gaierror) else socket.gaierror(str(e))
            return False
        for family, _, _, _, sockaddr in infos:
            try:
                with socket.socket(family, socket.SOCK_STREAM) as sock:
                    sock.settimeout(min(1.0, left))
                    sock.connect(sockaddr)
                    # A store's server waits for the client to speak; one that answers at once,
                    # or closes, is another program.
                    readable, _, _ = select.select([sock], [], [], _SPEAKS_FIRST_S)
                    if readable:
                        self.not_a_store = (
                            "accepts connections but closes them at once"
                            if not sock.recv(1, socket.MSG_PEEK)
                            else "answers before it is asked"
                        )
                        continue
                    self.not_a_store, self.last_error = "", None
                    return True
            except ConnectionResetError:
                self.not_a_store = "accepts connections but resets them"
            except OSError as e:
                self.last_error = e
        return False


def _unresolvable(host: str) -> bool:
    """Whether ``host`` does not resolve (asked on a helper thread, 1 s at most: DNS can hang)."""
    box: dict[str, bool] = {}

    def ask() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            box["resolves"] = True
        except (OSError, UnicodeError):
            box["resolves"] = False

    thread = threading.Thread(target=ask, name="phalanx-resolve", daemon=True)
    thread.start()
    thread.join(1.0)
    return box.get("resolves") is False


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
