"""The processes of one synchronous job and the collectives between them.

:class:`Communicator` is the protocol every part of phalanx talks to: collectives (all-reduce,
reduce, broadcast, all-gather, barrier), identity (rank, world size, names, hosts), the job's
store and subgroups. Three implementations:

* :class:`LocalCommunicator`: a single replica; every collective is the identity.
* :class:`~phalanx.comm.group_communicator.ProcessGroupCommunicator` (``group_communicator.py``):
  the processes of a job over torch.distributed (gloo, or NCCL on GPUs), with the same-host
  shared-memory fast path. It is assembled from
  :mod:`~phalanx.comm.rendezvous` (store and spec handshake), :mod:`~phalanx.comm.process_group`
  (group construction) and :mod:`~phalanx.comm.health` (heartbeat, dead-peer diagnosis), and
  translates transport failures into typed errors naming the peer (:meth:`errors_for`).
* :class:`phalanx.comm.threaded.ThreadedCommunicator`: several ranks as threads of one process,
  for tests.

Each is an object, not torch's global default group, so that a test can create two of them and
nothing leaks between strategies.

Example (world size 1 needs no peers)::

    >>> import torch
    >>> from phalanx.comm.communicator import LocalCommunicator
    >>> comm = LocalCommunicator()
    >>> comm.all_reduce(torch.ones(2)).wait()
    tensor([1., 1.])
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from phalanx.comm import rendezvous
from phalanx.comm.flight_recorder import DEFAULT_CAPACITY
from phalanx.comm.memory_store import InMemoryStore
from phalanx.errors import (
    CollectiveTimeoutError,
    PeerUnavailableError,
)

_TIMEOUT_TEXT = re.compile(r"timed out|timeout", re.IGNORECASE)


class Handle:
    """An asynchronous collective; :meth:`wait` returns its result tensor."""

    def __init__(
        self,
        tensor: torch.Tensor,
        wait_fn: Callable[[], None] | None = None,
        post: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self._tensor, self._wait_fn, self._post = tensor, wait_fn, post

    def wait(self) -> torch.Tensor:
        if self._wait_fn is not None:
            self._wait_fn()
            self._wait_fn = None
        if self._post is not None:
            self._tensor, self._post = self._post(self._tensor), None
        return self._tensor


@runtime_checkable
class Communicator(Protocol):
    """What phalanx needs from the processes of a job (see the module docstring).

    Attributes:
        rank: this process's index, ``0 .. world_size - 1``.
        world_size: the number of replicas of the job.
        step: the step being run, for error messages (set by ``strategy.run``).
    """

    rank: int
    world_size: int
    step: int | None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        """Starts an in-place all-reduce (sum, mean, max, min, product); ``.wait()`` ends it."""

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> torch.Tensor:
        """Sums ``tensor`` into rank ``dst``'s copy, in place."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrites ``tensor`` with rank ``src``'s, in place."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order."""

    def barrier(self) -> None:
        """Returns once every rank has called it."""

    def name(self, rank: int) -> str:
        """A rank's human name, e.g. ``"worker:1 (rank 1)"``."""

    def host_of(self, rank: int) -> str:
        """The host a rank runs on (ranks of one host share memory)."""

    @property
    def store(self) -> Any:
        """The job's key-value store, for small out-of-band exchanges."""

    def subgroup(self, ranks: list[int], tag: str, *, cuda: bool = False) -> Any:
        """A process group of ``ranks`` (this rank among them); NCCL for CUDA tensors where the job has it."""

    def errors_for(self, operation: str) -> contextlib.AbstractContextManager[None]:
        """Translates transport failures inside the block into typed errors naming the peer."""

    def close(self) -> None:
        """Releases everything; idempotent."""


def classify(error: BaseException) -> type[PeerUnavailableError]:
    """Which typed error a transport failure is: by exception type first, by its text last.

    torch raises ``DistNetworkError`` when a connection broke (a peer died), ``DistStoreError``
    for store failures (a timeout, or the store's host gone), ``DistBackendError`` from the
    backend (gloo/NCCL: timeouts and aborted peers). Only where the type does not decide (a store
    or backend error, a plain RuntimeError) does the message decide between a timeout and a lost
    peer.
    """
    if isinstance(error, (CollectiveTimeoutError, TimeoutError)):
        return CollectiveTimeoutError
    if isinstance(error, PeerUnavailableError):
        return type(error)
    if isinstance(error, dist.DistNetworkError):
        return PeerUnavailableError
    return CollectiveTimeoutError if _TIMEOUT_TEXT.search(str(error)) else PeerUnavailableError


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
    # A task still waiting at rendezvous this many seconds says once, on stderr, for whom (None: never).
    rendezvous_notice: float | None = None
    addresses: tuple[str, ...] = ()  # "host:port" per rank, where a cluster spec gives it (the notice names it)
    fingerprint: tuple[tuple[str, Any], ...] = ()  # extra fields that must agree (cluster spec)
    # Keys of this communicator in the job's store. A program's second strategy runs on the same
    # processes, store and port as its first: the prefix keeps their rendezvous apart.
    store_prefix: str = ""
    # Offered by the launcher that started this process's local peers (an interactive session):
    # raises, with the peer's own error, once one of them is known to have died. The rendezvous
    # calls it while it waits, so a replica that died before arriving ends the wait at once
    # rather than at the rendezvous timeout. Not part of what processes must agree on.
    peer_check: Callable[[], None] | None = field(default=None, compare=False)
    # The run directory a phalanx launcher made (LOGDIR/<run-id>): a failed collective's diagnosis is
    # written there for the launcher to print, and `phalanx diagnose --live` asks through it. ''
    # where no phalanx launcher watches (TF_CONFIG started by hand, torchrun): the replica prints it.
    run_dir: str = field(default="", compare=False)
    # Whether the launcher prints that diagnosis (phalanx run, self-launch): then the replica does not.
    launcher_prints: bool = field(default=False, compare=False)
    recorder_size: int = field(default=DEFAULT_CAPACITY, compare=False)  # PHALANX_FLIGHT_RECORDER
    # The job's store, already connected: an elastic job's re-formed group meets in the store its
    # first group met in (whoever its rank 0 is now), rather than connecting (or serving) again.
    store: Any = field(default=None, compare=False)
    # Whether a failed collective is diagnosed (every replica asked where it is, up to 2 s) before
    # it is raised. An elastic job re-forms its group instead and diagnoses only what it cannot heal.
    explain_failures: bool = field(default=True, compare=False)

    def name(self, rank: int) -> str:
        label = self.names[rank] if rank < len(self.names) else f"replica:{rank}"
        return label if label.endswith(f"rank {rank})") else f"{label} (rank {rank})"

    def address(self, rank: int) -> str:
        """The ``host:port`` of the task that runs ``rank``, or "" when no cluster spec says."""
        return self.addresses[rank] if rank < len(self.addresses) else ""


class LocalCommunicator:
    """The communicator of a single-replica job: every collective is the identity."""

    rank = 0
    world_size = 1
    step: int | None = None
    _store: Any = None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        return Handle(tensor)

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def barrier(self) -> None:
        return None

    def name(self, rank: int) -> str:
        return f"replica:{rank}"

    def host_of(self, rank: int) -> str:
        return rendezvous.host_id()

    @property
    def store(self) -> Any:
        """A store private to this process (nobody to share it with)."""
        if self._store is None:
            self._store = InMemoryStore()
        return self._store

    def subgroup(self, ranks: list[int], tag: str, *, cuda: bool = False) -> Any:
        raise NotImplementedError("a single-replica job has no subgroups")

    def errors_for(self, operation: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        return None


_JOB_STORES: dict[tuple[str, int, bool], Any] = {}  # (master address, port, serves it) -> store


def in_multi_process_job() -> bool:
    """Whether this process has joined a job of several processes (a communicator's rendezvous)."""
    return bool(_JOB_STORES)
