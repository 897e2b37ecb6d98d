"""The processes of one synchronous job and the collectives between them.

A :class:`Communicator` owns everything one process needs to talk to its peers: a TCPStore for
rendezvous, a gloo (or NCCL) process group, a heartbeat, and the translation of transport
failures into typed errors that name the peer. It is an object, not torch's global default group,
so that a test can create two of them and nothing leaks between strategies.

Example (world size 1 needs no peers)::

    >>> import torch
    >>> from phalanx.comm.communicator import LocalCommunicator
    >>> comm = LocalCommunicator()
    >>> comm.all_reduce(torch.ones(2)).wait()
    tensor([1., 1.])
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from phalanx.errors import (
    ClusterSpecMismatchError,
    CollectiveTimeoutError,
    PeerUnavailableError,
    RendezvousTimeoutError,
)

HEARTBEAT_INTERVAL = 0.25  # seconds; a peer whose counter stops for 4 intervals is unresponsive


class Handle:
    """An asynchronous collective; :meth:`wait` returns its result tensor."""

    def __init__(self, tensor: torch.Tensor, wait_fn: Callable[[], None] | None = None,
                 post: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._tensor, self._wait_fn, self._post = tensor, wait_fn, post

    def wait(self) -> torch.Tensor:
        if self._wait_fn is not None:
            self._wait_fn()
            self._wait_fn = None
        if self._post is not None:
            self._tensor, self._post = self._post(self._tensor), None
        return self._tensor


@dataclass(frozen=True)
class GroupSpec:
    """Where this process sits in its job; every process of the job must agree on all but ``rank``."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    bind_addr: str
    names: tuple[str, ...] = ()  # human names per rank, e.g. ("chief:0", "worker:0")
    timeout: float = 60.0  # every collective
    rendezvous_timeout: float = 60.0
    fingerprint: tuple[tuple[str, Any], ...] = ()  # extra fields that must agree (cluster spec)
    # Keys of this communicator in the job's store. A program's second strategy runs on the same
    # processes, store and port as its first: the prefix keeps their rendezvous apart.
    store_prefix: str = ""

    def name(self, rank: int) -> str:
        label = self.names[rank] if rank < len(self.names) else f"replica:{rank}"
        return label if label.endswith(f"rank {rank})") else f"{label} (rank {rank})"


class LocalCommunicator:
    """The communicator of a single-replica job: every collective is the identity."""

    rank = 0
    world_size = 1
    same_host = True
    step: int | None = None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        return Handle(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def barrier(self) -> None:
        return None

    def name(self, rank: int) -> str:
        return f"replica:{rank}"

    def host_of(self, rank: int) -> str:
        return socket.gethostname()

    def close(self) -> None:
        return None


def _listen_socket(host: str, port: int) -> socket.socket:
    # torch's TCPStore binds its server to every interface whatever host it is given; handing it a
    # socket we bound ourselves keeps the listener on the task's own address.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _host_id() -> str:
    """What makes two processes "the same host" (shared memory, /proc): the hostname.

    ``PHALANX_HOST_ID`` overrides it, so tests can make processes of one machine act as hosts.
    """
    return os.environ.get("PHALANX_HOST_ID") or socket.gethostname()


def _process_state(pid: int) -> str:
    """'R'/'S'/... from /proc, 'Z' for a zombie, 'T' when stopped, '' when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


_JOB_STORES: dict[tuple[str, int, bool], Any] = {}


class GlooCommunicator:
    """Collectives among the processes of a job over torch.distributed (gloo, or NCCL on GPUs).

    Args:
        spec: this process's place in the job; all processes must pass matching specs.
        backend: ``"gloo"`` or ``"nccl"``.

    Raises:
        RendezvousTimeoutError: not every rank arrived within ``spec.rendezvous_timeout``; the
            message names the missing ranks.
        ClusterSpecMismatchError: a peer was started with a different job description.
    """

    def __init__(self, spec: GroupSpec, backend: str = "gloo") -> None:
        if not spec.bind_addr:
            raise ValueError("GroupSpec.bind_addr must name this task's own address")
        self.spec = spec
        self.rank, self.world_size = spec.rank, spec.world_size
        self.step: int | None = None
        self._closed = False
        self._store = self._connect_store(spec)
        self._peers = self._rendezvous(spec)
        self._subgroups: list[Any] = []
        self.same_host = len({p["host"] for p in self._peers.values()}) == 1
        self.pg = self._make_group(backend, dist.PrefixStore("pg", self._store))
        self._shm, self._cross = self._fast_path(backend)
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="phalanx-heartbeat", daemon=True)
        self._heartbeat.start()
        # Closed at exit even when the strategy that made it is long gone: the heartbeat thread keeps
        # this object alive, and a daemon thread still inside a store call when the interpreter
        # finalises is killed by a forced unwind through C++ frames, which aborts the process
        # ("terminate called without an active exception", SIGABRT, after a successful run).
        atexit.register(self.close)

    # ----------------------------------------------------------------------------- set up
    def _connect_store(self, spec: GroupSpec) -> dist.Store:
        # One store (one listening port) per job and process, shared by the program's strategies.
        key = (spec.master_addr, spec.master_port, spec.rank == 0)
        if key not in _JOB_STORES:
            if not _JOB_STORES:
                atexit.register(_JOB_STORES.clear)  # after every communicator closed (LIFO)
            _JOB_STORES[key] = self._new_store(spec)
        store = _JOB_STORES[key]
        return dist.PrefixStore(spec.store_prefix, store) if spec.store_prefix else store

    def _new_store(self, spec: GroupSpec) -> dist.TCPStore:
        timeout = datetime.timedelta(seconds=spec.rendezvous_timeout)
        try:
            if spec.rank == 0:
                sock = _listen_socket(spec.bind_addr if spec.bind_addr else spec.master_addr, spec.master_port)
                return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, True, timeout,
                                     wait_for_workers=False, master_listen_fd=sock.detach())
            return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, timeout,
                                 wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            if spec.rank == 0:
                raise
            raise RendezvousTimeoutError([spec.name(0) + f" at {spec.master_addr}:{spec.master_port}"],
                                         spec.rendezvous_timeout) from e

    def _rendezvous(self, spec: GroupSpec) -> dict[int, dict[str, Any]]:
        """Publishes this rank's fingerprint, waits for everyone's and compares them."""
        mine = {"world_size": spec.world_size, "master": f"{spec.master_addr}:{spec.master_port}",
                **dict(spec.fingerprint)}
        me = {"fingerprint": mine, "host": _host_id(), "pid": os.getpid()}
        self._store.set(f"rdzv/{spec.rank}", json.dumps(me, sort_keys=True, default=str))
        deadline = time.monotonic() + spec.rendezvous_timeout
        peers: dict[int, dict[str, Any]] = {spec.rank: me}
        while True:
            for r in range(spec.world_size):
                if r not in peers and self._store.check([f"rdzv/{r}"]):
                    peers[r] = json.loads(self._store.get(f"rdzv/{r}"))
                    for field, value in mine.items():
                        theirs = peers[r]["fingerprint"].get(field)
                        if theirs != value:
                            raise ClusterSpecMismatchError(field, value, theirs, spec.name(r))
            # A peer that believes in a larger world publishes a rank we do not expect.
            if self._store.check([f"rdzv/{spec.world_size}"]):
                extra = json.loads(self._store.get(f"rdzv/{spec.world_size}"))
                raise ClusterSpecMismatchError("world_size", spec.world_size,
                                               extra["fingerprint"].get("world_size"),
                                               f"rank {spec.world_size}")
            if len(peers) == spec.world_size:
                return peers
            if time.monotonic() > deadline:
                missing = [spec.name(r) for r in range(spec.world_size) if r not in peers]
                raise RendezvousTimeoutError(missing, spec.rendezvous_timeout)
            time.sleep(0.01)

    def _make_group(self, backend: str, store: dist.Store) -> Any:
        timeout = datetime.timedelta(seconds=self.spec.timeout)
        with self._translate("process group creation"):
            if backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                return dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            # Gloo's listening sockets bind to the device's address: the task's own, never 0.0.0.0.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.spec.bind_addr)]
            return dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)

    def _fast_path(self, backend: str) -> tuple[Any, Any]:
        """Shared memory among the ranks of each host, gloo between hosts (hierarchical).

        Within a host, all-reduces go through a shared-memory segment: no sockets, no thread
        hand-offs. Across hosts, after the local sum, the ranks with the same local index
        all-reduce over gloo, so each host's sum crosses the network once per local rank and
        every rank ends with the same bits. ``PHALANX_SHM=0`` turns the fast path off.
        """
        if backend != "gloo" or os.environ.get("PHALANX_SHM", "1") == "0":
            return None, None
        from phalanx.comm.shm import ShmAllReduce

        hosts: dict[str, list[int]] = {}
        for r in sorted(self._peers):
            hosts.setdefault(str(self._peers[r]["host"]), []).append(r)
        order = sorted(hosts, key=lambda h: hosts[h][0])
        mine = hosts[str(self._peers[self.rank]["host"])]
        if len(hosts) > 1 and len({len(v) for v in hosts.values()}) != 1:
            return None, None  # uneven hosts: plain gloo keeps every rank's collectives alike
        shm = None
        if len(mine) > 1:
            with self._translate("shared-memory set-up"):
                shm = ShmAllReduce(mine.index(self.rank), len(mine),
                                   dist.PrefixStore(f"shm/{order.index(str(self._peers[self.rank]['host']))}",
                                                    self._store), timeout=self.spec.timeout)
        cross = None
        if len(hosts) > 1:
            k = mine.index(self.rank)
            cross = self.subgroup([hosts[h][k] for h in order], tag=f"cross-host-{k}")
        return shm, cross

    def _beat(self) -> None:
        # The heartbeat shares the communicator's store client (its operations are serialised)
        # rather than owning one: a C++ client still connecting or waiting inside this thread
        # when the interpreter exits was seen to abort the process ("terminate called ...").
        count = 0
        while not self._stop.wait(HEARTBEAT_INTERVAL):
            count += 1
            try:
                self._store.set(f"hb/{self.rank}", str(count))
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending or rank 0 died
                return

    # ----------------------------------------------------------------------------- failures
    def _unresponsive_peers(self) -> list[int]:
        """Ranks that are dead or stopped: /proc for peers on this host, heartbeats for the rest."""
        host = _host_id()
        local = [r for r, info in self._peers.items() if r != self.rank and info["host"] == host]
        remote = [r for r in self._peers if r != self.rank and r not in local]
        suspects: list[int] = []
        # A peer whose socket just closed may still be exiting; give it a moment to be gone.
        deadline = time.monotonic() + 1.0
        while local and not suspects and time.monotonic() < deadline:
            suspects = [r for r in local if _process_state(self._peers[r]["pid"]) in ("", "Z", "X", "T", "t")]
            if not suspects:
                time.sleep(0.02)
        if remote:
            try:
                client = dist.TCPStore(self.spec.master_addr, self.spec.master_port, self.world_size, False,
                                       datetime.timedelta(seconds=2), wait_for_workers=False)
                if self.spec.store_prefix:
                    client = dist.PrefixStore(self.spec.store_prefix, client)

                def beats() -> dict[int, bytes]:
                    return {r: client.get(f"hb/{r}") if client.check([f"hb/{r}"]) else b"" for r in remote}

                before = beats()
                time.sleep(4 * HEARTBEAT_INTERVAL)
                after = beats()
                suspects += [r for r in remote if after[r] == before[r]]
            except Exception:  # noqa: BLE001 - the store lives in rank 0's process
                suspects.append(0)
        return sorted(set(suspects))

    @contextlib.contextmanager
    def _translate(self, operation: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as e:  # DistBackendError, DistNetworkError, DistStoreError
            if isinstance(e, PeerUnavailableError):
                raise
            text = str(e)
            peers = [self.spec.name(r) for r in self._unresponsive_peers()] if hasattr(self, "_peers") else []
            cls = CollectiveTimeoutError if "imed out" in text or "imeout" in text else PeerUnavailableError
            first_line = text.strip().splitlines()[0] if text.strip() else type(e).__name__
            raise cls(peers, step=self.step, operation=f"{operation} on {self.spec.name(self.rank)}",
                      cause=first_line[:300]) from e

    # ----------------------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        """Starts an in-place all-reduce of ``tensor``; ``op`` is sum, mean, max, min or product."""
        native = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                  "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}[op]
        if (self._shm is not None or self._cross is not None) and tensor.device.type == "cpu":
            return self._hierarchical_all_reduce(tensor, op, native)
        with self._translate("all-reduce"):
            work = self.pg.allreduce([tensor], native)
        post = (lambda t: t.div_(self.world_size)) if op == "mean" else None
        return Handle(tensor, lambda: self._wait(work, "all-reduce"), post)

    def _hierarchical_all_reduce(self, tensor: torch.Tensor, op: str, native: Any) -> Handle:
        if self._shm is not None:
            try:
                self._shm.all_reduce(tensor, "sum" if op == "mean" else op)
            except PeerUnavailableError as e:  # keep its kind (dead vs stalled); name peers the job's way
                peers = [self.spec.name(r) for r in self._unresponsive_peers()]
                raise type(e)(peers, step=self.step, operation=f"all-reduce on {self.spec.name(self.rank)}",
                              cause=str(e.args[0]).split(" HINT:")[0][:300]) from e
        with self._translate("all-reduce"):
            if self._cross is not None:
                self._cross.allreduce([tensor], native).wait()
        if op == "mean":
            tensor.div_(self.world_size) if tensor.is_floating_point() else tensor.floor_divide_(self.world_size)
        return Handle(tensor)

    def _wait(self, work: Any, operation: str) -> None:
        with self._translate(operation):
            work.wait()

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> torch.Tensor:
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = dst, dist.ReduceOp.SUM
        with self._translate("reduce"):
            self.pg.reduce([tensor], opts).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        with self._translate("broadcast"):
            self.pg.broadcast([tensor], opts).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Returns every rank's ``tensor`` (all of the same shape), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._translate("all-gather"):
            self.pg.allgather([out], [tensor.contiguous()]).wait()
        return out

    def barrier(self) -> None:
        with self._translate("barrier"):
            self.pg.barrier().wait()

    def name(self, rank: int) -> str:
        return self.spec.name(rank)

    def host_of(self, rank: int) -> str:
        return str(self._peers[rank]["host"])

    @property
    def store(self) -> dist.Store:
        """The job's key-value store (rendezvous), for small out-of-band exchanges."""
        return self._store

    def subgroup(self, ranks: list[int], tag: str) -> Any:
        """A gloo group of ``ranks`` (this rank among them); only its members construct it."""
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=self.spec.timeout)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.spec.bind_addr)]
        with self._translate(f"creating group {tag}"):
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"sub/{tag}", self._store),
                                          ranks.index(self.rank), len(ranks), opts)
        self._subgroups.append(group)
        return group

    def close(self) -> None:
        """Stops the heartbeat and releases the process group; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        if self._shm is not None:
            self._shm.close()
        self._heartbeat.join(timeout=6)  # it may be inside a store call with a 5 s timeout
        # Shut the groups down while the interpreter is whole: gloo's worker threads may still hold
        # work objects whose tensors need the GIL to be freed.
        for group in [*self._subgroups, self.pg]:
            with contextlib.suppress(Exception):
                group.shutdown()
        self._subgroups.clear()
        self.pg = None
