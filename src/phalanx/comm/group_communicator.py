"""A synchronous job's processes over torch.distributed: :class:`ProcessGroupCommunicator`.

The :class:`~phalanx.comm.communicator.Communicator` of a job of several processes (gloo, or NCCL
on GPUs, with gloo beside it for CPU tensors), with the same-host shared-memory fast path
(:mod:`~phalanx.comm.shm`). It is assembled from :mod:`~phalanx.comm.rendezvous` (store and spec
handshake), :mod:`~phalanx.comm.process_group` (group construction) and
:mod:`~phalanx.comm.health` (heartbeat, dead-peer diagnosis); it translates transport failures
into typed errors naming the peer (:meth:`ProcessGroupCommunicator.errors_for`) and, when a
collective fails, asks every replica where it is (:mod:`~phalanx.comm.diagnosis`), through the
collaborator it holds for failures (``comm.failures``, :mod:`~phalanx.comm.peer_failures`). The protocol,
:class:`~phalanx.comm.communicator.GroupSpec` and the one-replica communicator are in
:mod:`phalanx.comm.communicator`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from phalanx._signal_routing import helper_threads_ignore_stop_signals
from phalanx.comm import health, process_group, rendezvous, snapshot
from phalanx.comm.communicator import _JOB_STORES, GroupSpec, Handle
from phalanx.comm.flight_recorder import FlightRecorder
from phalanx.comm.peer_failures import PeerFailures
from phalanx.comm.timing import MARKS, CollectiveTimes
from phalanx.errors import (
    CollectiveMismatchError,
    PeerUnavailableError,
    ReplicaDivergenceError,
)

HEARTBEAT_INTERVAL = health.HEARTBEAT_INTERVAL  # read at construction (tests shorten it)


class _NoTensor:
    """What a barrier records as its tensor: nothing."""

    dtype = None

    @staticmethod
    def numel() -> int:
        return 0


_NO_TENSOR = _NoTensor()


class ProcessGroupCommunicator:
    """Collectives among the processes of a job over torch.distributed (gloo, or NCCL on GPUs).

    Args:
        spec: this process's place in the job; all processes must pass matching specs.
        backend: ``"gloo"`` or ``"nccl"``.

    Raises:
        RendezvousTimeoutError: not every rank arrived within ``spec.rendezvous_timeout``; the
            message names the missing ranks (the first few, and how many).
        ClusterSpecMismatchError: a peer was started with a different job description.
        ClusterSpecError: an address does not resolve, is not this host's, or its port is taken.
    """

    def __init__(self, spec: GroupSpec, backend: str = "gloo") -> None:
        if not spec.bind_addr:
            raise ValueError("GroupSpec.bind_addr must name this task's own address")
        self.spec = spec
        self.rank, self.world_size = spec.rank, spec.world_size
        self.step: int | None = None
        self.times = CollectiveTimes()  # the job report's share of time spent in collectives
        # The last collectives, for a diagnosis when the job hangs or its replicas' calls part.
        self.recorder = FlightRecorder(spec.recorder_size)
        # Typed errors naming the peer, the job's diagnosis, the chief's wait (comm/peer_failures.py).
        self.failures = PeerFailures(self, HEARTBEAT_INTERVAL)
        self._closed = False
        me = spec.name(spec.rank)
        rendezvous.check_bind_address(spec.bind_addr, me, spec.address(spec.rank))  # its port for errors
        # Once for the store and the peers. Peers no cluster spec lists were started by this job's
        # launcher, with this process or by it: they are late only against how long it took to start.
        started_in = None if spec.addresses else rendezvous.process_age()
        notice = rendezvous.WaitNotice(spec.rendezvous_notice, started_in=started_in)
        # One store (one listening port) per job and process, shared by the program's strategies;
        # each strategy's keys live under its own prefix (a program may create several).
        key = (spec.master_addr, spec.master_port, spec.rank == 0)
        if spec.store is not None:  # an elastic job's re-formed group: the store its first group met in
            self._store = spec.store
        elif key not in _JOB_STORES:
            if not _JOB_STORES:
                atexit.register(_JOB_STORES.clear)  # after every communicator closed (LIFO)
            _JOB_STORES[key] = rendezvous.connect_store(
                rank=spec.rank,
                world_size=spec.world_size,
                master_addr=spec.master_addr,
                master_port=spec.master_port,
                bind_addr=spec.bind_addr,
                timeout=spec.rendezvous_timeout,
                master_task=spec.name(0),
                task=me,
                notice=notice,
            )
        if spec.store is None:
            self._store = _JOB_STORES[key]
        if spec.store_prefix:
            self._store = dist.PrefixStore(spec.store_prefix, self._store)
        fingerprint = {
            "world_size": spec.world_size,
            "master": f"{spec.master_addr}:{spec.master_port}",
            **dict(spec.fingerprint),
        }
        self._peers = rendezvous.exchange(
            self._store,
            rank=spec.rank,
            world_size=spec.world_size,
            fingerprint=fingerprint,
            timeout=spec.rendezvous_timeout,
            name=spec.name,
            check=spec.peer_check,
            notice=notice,
            address=spec.address,
        )
        self.failures.joined(self._store, self._peers)
        self._subgroups: list[Any] = []
        self._host_ranks: list[int] = []  # the global ranks of this host, in shared-memory rank order
        # gloo's threads start here; peers have all checked in above, so this is short.
        self.backend = backend
        with self.errors_for("process group creation"), helper_threads_ignore_stop_signals():
            self.pg = process_group.make_group(
                backend,
                dist.PrefixStore("pg", self._store),
                self.rank,
                self.world_size,
                timeout=spec.timeout,
                bind_addr=spec.bind_addr,
            )
            # NCCL reduces CUDA tensors only; the job's CPU tensors (the guard's control values, a
            # host tensor passed to strategy.reduce, the input's end-of-data agreement, barriers)
            # go through a gloo group beside it, as DDP's users do with a second group.
            self._cpu_pg = (
                self.pg
                if backend == "gloo"
                else process_group.gloo_group(
                    dist.PrefixStore("cpu-pg", self._store),
                    self.rank,
                    self.world_size,
                    timeout=spec.timeout,
                    bind_addr=spec.bind_addr,
                )
            )
        self._shm, self._cross = self._fast_path()
        # The heartbeat thread also answers requests for this replica's snapshot (a diagnosis).
        self._agent = snapshot.Agent(self.failures.take_snapshot, self.rank, spec.run_dir or None)
        self._heartbeat = health.Heartbeat(self._store, self.rank, HEARTBEAT_INTERVAL, on_beat=self._agent.poll)
        # Closed at exit even when the strategy that made it is long gone: the heartbeat thread keeps
        # this object alive, and a daemon thread still inside a store call when the interpreter
        # finalises is killed by a forced unwind through C++ frames, which aborts the process
        # ("terminate called without an active exception", SIGABRT, after a successful run).
        atexit.register(self.close)

    # ----------------------------------------------------------------------------- set up
    def _fast_path(self) -> tuple[Any, Any]:
        """Shared memory among the ranks of each host, gloo between hosts (hierarchical), for CPU tensors.

        Within a host, all-reduces go through a shared-memory segment: no sockets, no thread
        hand-offs. Across hosts, after the local sum, the ranks with the same local index
        all-reduce over gloo, so each host's sum crosses the network once per local rank and
        every rank ends with the same bits. ``PHALANX_SHM=0`` turns the fast path off. CUDA
        tensors never take it: they go through the main group (NCCL, or gloo's CUDA path).
        """
        if os.environ.get("PHALANX_SHM", "1") == "0":
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
        self._host_ranks = mine
        if len(mine) > 1:
            with self.errors_for("shared-memory set-up"):
                shm = ShmAllReduce(
                    mine.index(self.rank),
                    len(mine),
                    dist.PrefixStore(f"shm/{order.index(str(self._peers[self.rank]['host']))}", self._store),
                    timeout=self.spec.timeout,
                )
        cross = None
        if len(hosts) > 1:
            k = mine.index(self.rank)
            cross = self.subgroup([hosts[h][k] for h in order], tag=f"cross-host-{k}")
        return shm, cross

    @property
    def shared_memory(self) -> bool:
        """Whether all-reduces of CPU tensors among this host's ranks go through shared memory.

        There, a small all-reduce costs a few microseconds and a large one runs at memory speed,
        where a gloo collective pays a loopback round trip (~200-600 us) per call.
        """
        return self._shm is not None

    # ----------------------------------------------------------------------------- failures
    # Translation into typed errors, the job's diagnosis and the chief's wait: comm/peer_failures.py.
    def errors_for(self, operation: str, slot: int | None = None) -> contextlib.AbstractContextManager[None]:
        """Translates a transport failure inside the block into a typed error naming the peer; with the
        flight recorder's ``slot`` of the collective, diagnosed first (:meth:`PeerFailures.errors_for`)."""
        return self.failures.errors_for(operation, slot)

    def diagnose(self, *, trigger: dict[str, Any] | None = None, live: bool = False) -> dict[str, Any]:
        """Asks every replica where it is and puts the answers side by side (:meth:`PeerFailures.diagnose`)."""
        return self.failures.diagnose(trigger=trigger, live=live)

    def wait_for_chief(self, what: str = "chief-only work") -> contextlib.AbstractContextManager[None]:
        """Work that the chief (rank 0) does alone inside the block; the others wait at its end, for
        as long as rank 0 is alive (:meth:`PeerFailures.wait_for_chief`)."""
        return self.failures.wait_for_chief(what)

    def explain(self, error: BaseException) -> BaseException:
        """The error to raise for a failed collective: ``error`` with the job's diagnosis, the first
        time only (:meth:`PeerFailures.explain`). Never raises."""
        return self.failures.explain(error)

    _translate = errors_for  # the former private name

    # ----------------------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        """Starts an in-place all-reduce of ``tensor``; ``op`` is sum, mean, max, min or product."""
        native = {
            "sum": dist.ReduceOp.SUM,
            "mean": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
            "product": dist.ReduceOp.PRODUCT,
        }[op]
        if (self._shm is not None or self._cross is not None) and tensor.device.type == "cpu":
            # Synchronous: the wait for the peers is inside the call. Timed and recorded inline
            # (no context manager) because this is the gradient buckets' path.
            start = time.perf_counter()
            rec = self.recorder
            slot = rec.begin("all_reduce", tensor, self.step, start)
            try:
                if MARKS.active:
                    with torch.profiler.record_function("phalanx::all_reduce"):
                        handle = self._hierarchical_all_reduce(tensor, op, native)
                else:
                    handle = self._hierarchical_all_reduce(tensor, op, native)
            except BaseException as e:
                rec.failed(slot, e)
                self.times.add(time.perf_counter() - start)
                explained = self.explain(e)
                if explained is e:
                    raise
                raise explained from (e.__cause__ or e)  # the transport's own error, not the same one twice
            end = time.perf_counter()
            rec.ends[slot] = end
            self.times.add(end - start)
            return handle
        slot = self.recorder.begin("all_reduce", tensor, self.step, time.perf_counter())
        with self.errors_for("all-reduce", slot):
            # NCCL's work.wait() only orders the current CUDA stream after the collective: the
            # host goes on, and backward overlaps the gradient buckets as DDP's do.
            work = self._group_for(tensor).allreduce([tensor], native)
        post = (lambda t: t.div_(self.world_size)) if op == "mean" else None
        return Handle(tensor, lambda: self._wait(work, "all-reduce", slot), post)

    def _hierarchical_all_reduce(self, tensor: torch.Tensor, op: str, native: Any) -> Handle:
        if self._shm is not None:
            try:
                # The step travels beside the call's signature: calls that do not match say where each rank was.
                self._shm.all_reduce(tensor, "sum" if op == "mean" else op, tag=self.step)
            except CollectiveMismatchError as e:
                divergence = self._out_of_step(e)
                if divergence is None:
                    raise
                raise divergence from e
            except PeerUnavailableError as e:  # keep its kind (dead vs stalled); name peers the job's way
                # The ranks the shared-memory wait named (this host's indices), as the job names
                # them; else those found dead or stopped.
                local = [int(p.split()[-1]) for p in e.peers if p.startswith("rank ") and p.split()[-1].isdigit()]
                peers = [self.spec.name(self._host_ranks[j]) for j in local if j < len(self._host_ranks)]
                peers = peers or [self.spec.name(r) for r in self.failures.unresponsive_peers()]
                raise type(e)(
                    peers,
                    step=self.step,
                    operation=f"all-reduce on {self.spec.name(self.rank)}",
                    cause=str(e.args[0]).split(" HINT:")[0][:300],
                ) from e
        with self.errors_for("all-reduce"):
            if self._cross is not None:
                self._cross.allreduce([tensor], native).wait()
        if op == "mean":
            tensor.div_(self.world_size) if tensor.is_floating_point() else tensor.floor_divide_(self.world_size)
        return Handle(tensor)

    def _out_of_step(self, error: CollectiveMismatchError) -> ReplicaDivergenceError | None:
        """The divergence behind calls that do not match, where the ranks were at different steps.

        A replica that skipped a step (an exception its loop caught) sends its next step's first
        collective while its peers send this step's: the tensors differ, and so do the steps.
        Compared with the host's first rank, so every rank raises the same error.
        """
        tags, ranks = error.tags, self._host_ranks
        for j, tag in enumerate(tags):
            if tag != tags[0]:
                return ReplicaDivergenceError(
                    "step", (self.spec.name(ranks[0]), self.spec.name(ranks[j])), (tags[0], tag), step=tags[0]
                )
        return None

    def _wait(self, work: Any, operation: str, slot: int | None = None) -> None:
        # Only the wait is timed: starting an asynchronous collective returns at once, and the
        # time between start and wait is the overlap with backward, not waiting. On a GPU the
        # recorded end is when the host handed the wait to the stream, not the kernel's end
        # (torch's NCCL Flight Recorder has that: TORCH_NCCL_TRACE_BUFFER_SIZE).
        with self.times.measure(operation.replace("-", "_")), self.errors_for(operation, slot):
            work.wait()
        if slot is not None:
            self.recorder.ends[slot] = time.perf_counter()

    def _group_for(self, tensor: torch.Tensor) -> Any:
        """The group that reduces ``tensor``: NCCL for CUDA tensors of an NCCL job, gloo otherwise."""
        return self.pg if tensor.is_cuda else self._cpu_pg

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> torch.Tensor:
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = dst, dist.ReduceOp.SUM
        group = self._group_for(tensor)
        slot = self.recorder.begin("reduce", tensor, self.step, time.perf_counter())
        with self.times.measure("reduce"), self.errors_for("reduce", slot):
            if tensor.is_cuda and group is self._cpu_pg:
                # gloo reduces CUDA tensors only in all-reduce and broadcast: stage through the host.
                host = tensor.cpu()
                group.reduce([host], opts).wait()
                tensor.copy_(host)
            else:
                group.reduce([tensor], opts).wait()
        self.recorder.ends[slot] = time.perf_counter()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        slot = self.recorder.begin("broadcast", tensor, self.step, time.perf_counter())
        with self.times.measure("broadcast"), self.errors_for("broadcast", slot):
            self._group_for(tensor).broadcast([tensor], opts).wait()
        self.recorder.ends[slot] = time.perf_counter()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Returns every rank's ``tensor`` (all of the same shape), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        slot = self.recorder.begin("all_gather", tensor, self.step, time.perf_counter())
        with self.times.measure("all_gather"), self.errors_for("all-gather", slot):
            self._group_for(tensor).allgather([out], [tensor.contiguous()]).wait()
        self.recorder.ends[slot] = time.perf_counter()
        return out

    def barrier(self) -> None:
        # Through gloo even in an NCCL job: NCCL's barrier is an all-reduce on a guessed device.
        slot = self.recorder.begin("barrier", _NO_TENSOR, self.step, time.perf_counter())
        with self.times.measure("barrier"), self.errors_for("barrier", slot):
            self._cpu_pg.barrier().wait()
        self.recorder.ends[slot] = time.perf_counter()

    def name(self, rank: int) -> str:
        return self.spec.name(rank)

    def host_of(self, rank: int) -> str:
        return str(self._peers[rank]["host"])

    @property
    def store(self) -> dist.Store:
        """The job's key-value store (rendezvous), for small out-of-band exchanges."""
        return self._store

    def subgroup(self, ranks: list[int], tag: str, *, cuda: bool = False) -> Any:
        """A group of ``ranks`` (this rank among them); only its members construct it.

        gloo, or NCCL with ``cuda=True`` in an NCCL job (for CUDA tensors).
        """
        nccl = cuda and self.backend == "nccl"
        with self.errors_for(f"creating group {tag}"):
            group = process_group.make_group(
                "nccl" if nccl else "gloo",
                dist.PrefixStore(f"sub/{tag}{'/nccl' if nccl else ''}", self._store),
                ranks.index(self.rank),
                len(ranks),
                timeout=self.spec.timeout,
                bind_addr=self.spec.bind_addr,
            )
        self._subgroups.append(group)
        return group

    def _groups(self) -> list[Any]:
        return [*self._subgroups, self.pg] + ([self._cpu_pg] if self._cpu_pg is not self.pg else [])

    def abort(self) -> None:
        """Leaves this group's collectives for good, so that no peer waits for this rank in one: a
        peer waiting in shared memory raises at its next liveness check, one in gloo sees this
        rank's connections close. The heartbeat goes on until :meth:`close` (an elastic job calls
        this before it re-forms its group, while its peers still look for the dead)."""
        if self._shm is not None:
            self._shm.abort()
        for group in self._groups():
            with contextlib.suppress(Exception):
                group.shutdown()

    def close(self) -> None:
        """Stops the heartbeat and releases the process group; idempotent.

        In a launcher's run directory it leaves its last collectives behind (``ended``): a peer
        still waiting in a collective this replica never made can then say so, rather than call
        it dead.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.spec.run_dir and self.recorder.seq:
            with contextlib.suppress(Exception):  # a diagnosis never fails a job
                snapshot.leave_final(
                    self.spec.run_dir, {**self.failures.take_snapshot(sample_cpu=False), "ended": True}
                )
        if self._shm is not None:
            self._shm.close()
        self._heartbeat.stop()
        # Shut the groups down while the interpreter is whole: gloo's worker threads may still hold
        # work objects whose tensors need the GIL to be freed.
        for group in self._groups():
            with contextlib.suppress(Exception):
                group.shutdown()
        self._subgroups.clear()
        self.pg = self._cpu_pg = None
