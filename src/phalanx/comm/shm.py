"""Same-host shared-memory all-reduce among the processes of one job.

The processes of a job that share a host exchange tensors through one shared-memory segment
instead of loopback TCP, as NCCL's SHM transport and DeepSpeed's CPU all-reduce do. Gloo pays
~200-600 us per call on thread hand-offs and socket wake-ups; here a small all-reduce is a
copy, a counter store and a few vectorised array ops on the calling thread.

Protocol. Every call is split into *steps* (one step for a small tensor, one per chunk for a
large one); all ranks run the same steps, numbered 1, 2, ... Each rank owns two int64 counters in
the segment header, ``arrived`` and ``reduced``, which only it writes, so no atomics are needed:
a peer learns that a step's data is in place by reading the counter. Data regions are
double-buffered by step parity, so a rank may start step ``s + 1`` while a peer still reads
step ``s``; it can only reach step ``s + 2`` after every peer arrived at ``s + 1``, that is after
every peer finished reading step ``s``. Hence one wait per step for small tensors and two
(reduce-scatter, all-gather) for large ones.

Determinism. Every element is reduced in rank order (``((x0 + x1) + x2) ...``), rounding after
each binary op in the tensor's dtype, by the same code on every rank, so all ranks get the same
bits and SUM equals the rank-order sum computed with torch.

Threads. Nothing here uses torch's intra-op thread pool (see ``_STORAGE``), so results and speed
do not depend on ``torch.set_num_threads``, and no global setting is touched.

Waiting. A rank that waits for its peers spins for a while, then sleeps in the kernel on a
futex over the awaited counter, which the publishing rank wakes (see ``_Spin`` for when it
spins); it gives its core back to a peer that needs it, as gloo's waits do.

Failure. Every wait has a deadline and checks the peers' liveness (every 5 ms, backing off to
100 ms in a long wait), so a dead peer raises :class:`~phalanx.errors.PeerUnavailableError` and a
stalled one :class:`~phalanx.errors.CollectiveTimeoutError`; the instance is then closed. The
segment file is unlinked as soon as every rank has mapped it, so nothing is left in ``/dev/shm``
even if every process is killed with SIGKILL.

Example (run in each of the ``world_size`` processes of a job)::

    store = torch.distributed.TCPStore("127.0.0.1", port, world_size, rank == 0)
    comm = ShmAllReduce(rank, world_size, store)
    grad = torch.ones(1000)
    comm.all_reduce(grad, op="mean")  # in place
    comm.close()
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import secrets
import sys
import tempfile
import time
import weakref
from typing import Any

import numpy as np
import torch

from phalanx.comm import wait_stats
from phalanx.comm.core_packing import Placement
from phalanx.comm.health import alive, start_time
from phalanx.comm.wait_stats import WaitStats
from phalanx.config import Settings
from phalanx.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedRuntimeError,
    PeerUnavailableError,
    RendezvousTimeoutError,
)

__all__ = ["DTYPES", "ShmAllReduce"]

_UFUNCS = {"sum": np.add, "mean": np.add, "product": np.multiply, "max": np.maximum, "min": np.minimum}
_TORCH_FNS = {"sum": torch.add, "mean": torch.add, "product": torch.mul, "max": torch.maximum, "min": torch.minimum}
_OP_CODES = {name: code for code, name in enumerate(_UFUNCS)}
# Data moves as numpy arrays over the tensors' memory: numpy never starts threads, while a
# torch op above 32768 elements enters the intra-op pool, and with 2 threads in each of 2
# processes on 2 cores, pool threads and waiting peers starve each other (1 MB: 130 ms).
_STORAGE = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.bfloat16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
}
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_STORAGE)}
DTYPES = frozenset(_STORAGE)  # the dtypes ShmAllReduce reduces
# numpy has no bfloat16 and no vectorised float16 math (40x slower than torch), and no
# truncating integer division: these use torch ops of at most at::internal::GRAIN_SIZE
# elements, which torch runs on the calling thread.
_TORCH_MATH = (torch.float16, torch.bfloat16)
_GRAIN = 32768

_MAGIC = 0x3178_6E61_6C61_6870  # b"phalanx1", little-endian
# Control block of one rank, in int64 slots: `arrived` shares its cache line with the step
# signatures and the callers' tags written just before it (one line transfer per step);
# `reduced` sits 128 bytes further so the adjacent-line prefetcher does not couple the two.
_RANK_BYTES = 256
_ARRIVED, _SIG, _TAG, _REDUCED = 0, 1, 3, 16  # _SIG + parity, _TAG + parity
# Non-zero while the rank sleeps on a peer's counter (a futex on the counter's low 32 bits): a
# rank that publishes makes the wake-up system call only then. On its own cache line.
_SLEEPING = 8
# This rank's compute thread's nanoseconds on a core and runnable (see `Placement`), published once
# per placement window, on a cache line of their own.
_RUN, _RUNNABLE = 24, 25
_CHOICE = 2  # header word 2: the leader's placement, the chosen core + 1 (0: spread)
# Header word 3: non-zero once a rank left the group's collectives for good (an elastic job that
# re-forms without a dead peer): a rank waiting for it raises at its next liveness check.
_ABORTED = 3
_LOW_WORD = 0 if sys.byteorder == "little" else 4  # the byte offset of an int64's low 32 bits
_NO_TAG = -(1 << 63)  # the tag slot of a call made without a tag
_ALIGN = 64  # slice boundaries on cache lines: no false sharing, aligned vector loads

# Tuned on a 2-core VM, 2 processes (medians of 7 interleaved rounds): up to 256 KiB one copy
# + every rank reducing everything (32 KiB: 14 us, 256 KiB: 30 us) beats reduce-scatter/
# all-gather with its second wait (22, 37 us; equal at 512 KiB). Steps of 1 MiB gave the best
# bandwidth at 1/16/64 MiB (12/9.3/9.0 GB/s; 256 KiB steps: 8.6/6.9/6.7, 4 MiB: 12/5.4/6.0,
# where a step no longer stays in the caches between the peers' passes).
_SMALL_MAX_BYTES = 256 << 10
_MAX_CHUNK_BYTES = 1 << 20

# Waiting (Linux): spin, then sleep in the kernel on a futex that the arriving rank wakes, as
# gloo's waits do. The old wait spun, yielded the core for 2 ms, then napped 50 us-1 ms in a loop:
# a rank waiting for a peer that lost its core (a busy neighbour, a DataLoader worker, hypervisor
# steal) polled for as long as the peer was away. Short waits still spin: in the middle of a
# chunked all-reduce the ranks run in step and a peer publishes within microseconds, and a sleep
# costs a wake-up (on a 2-core Firecracker VM a woken vCPU took 20-300 us to run again, 0.28 ms a
# step at 2 ms of imbalance between replicas; on a crowded host, a scheduler slice). So a wait
# polls for 5 us, then yields the core to a peer that may share it for as long as the old yield
# phase did, and then sleeps (see `_Spin`). Without futexes: spin, yield, then nap.
_PURE_SPIN_S, _SPIN_S = 5e-6, 2e-3
_YIELD_S, _MIN_SLEEP_S, _MAX_SLEEP_S = 2e-3, 50e-6, 1e-3  # the fallback without futexes
# Liveness checks while waiting: every 5 ms at first, backing off to 100 ms for a long wait, so a
# rank asleep for a late peer wakes ~20 times a second and a dead peer is still named at once.
_LIVENESS_S, _MAX_LIVENESS_S = 5e-3, 0.1

# x86-64 is TSO: a store is never seen before an earlier store, so a peer that sees a counter
# sees the data written before it. Elsewhere use sched_yield as a fence: the kernel's
# schedule path executes a full memory barrier.
_NEEDS_FENCE = platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386")
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# The /proc readers are shared with the communicator's diagnosis of failed collectives.
_start_time, _alive = start_time, alive


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE (futex(2)) on 32-bit words of a shared mapping, through ctypes.

    Not FUTEX_PRIVATE: the waiters are other processes. ``available`` is False off Linux or on an
    architecture whose syscall number is not known here; the waits then poll.
    """

    _NUMBERS = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
    _WAIT, _WAKE = 0, 1

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def __init__(self) -> None:
        number = self._NUMBERS.get(platform.machine().lower()) if sys.platform.startswith("linux") else None
        self._syscall: Any = None
        if number is not None:
            try:
                syscall = ctypes.CDLL(None, use_errno=True).syscall
            except (OSError, AttributeError):
                syscall = None
            if syscall is not None:
                syscall.restype = ctypes.c_long
                self._syscall, self._number = syscall, ctypes.c_long(number)  # a long: all 64 bits set
        self.available = self._syscall is not None
        self._timeout = self._Timespec()
        self._timeout_ref = ctypes.byref(self._timeout)

    def wait(self, address: int, expected: int, timeout: float) -> None:
        """Sleeps while the word at ``address`` equals ``expected`` (int32), at most ``timeout`` s.

        Returns at a wake-up, on a value that already differs, at the timeout or on a signal; the
        caller re-reads what it waits for in every case.
        """
        self._timeout.tv_sec = int(timeout)
        self._timeout.tv_nsec = int((timeout - int(timeout)) * 1e9)
        self._syscall(
            self._number, ctypes.c_void_p(address), self._WAIT, ctypes.c_int(expected), self._timeout_ref, None, 0
        )

    def wake(self, address: int) -> None:
        """Wakes every process sleeping on the word at ``address``."""
        self._syscall(self._number, ctypes.c_void_p(address), self._WAKE, ctypes.c_int(0x7FFFFFFF), None, None, 0)


_FUTEX = _Futex()


def _finish(seg: _Segment | None, stats: WaitStats | None, placement: Placement | None = None) -> None:
    """What closing (or exiting) does: writes the wait statistics, if on, puts the threads back on
    their own cores, and unmaps the segment."""
    if stats is not None:
        stats.write()
    if placement is not None:
        placement.restore()
    if seg is not None:
        seg.release()


class _Spin:
    """How long a wait spins (polling, then yielding the core) before it sleeps on the futex.

    ``_SPIN_S``, unless the job itself has more replicas on this host than there are cores: then a
    spinning rank holds the very core a peer it waits for needs, and it sleeps at once.

    Not shortened (or lengthened) when other tasks crowd the host: the waits are not what a busy
    host costs. With one busy process per core and a DataLoader with 2 workers beside the 2
    replicas of the large MLP on a 2-core VM (``python -m benchmarks.load_diag``, issue 33), a
    replica's waits cost it a median 1.5 % of its CPU time (the yields hand the core over), and
    the loaded jobs that collapse, DDP's as often as phalanx's, lose seconds runnable in the run
    queue, mostly while the scheduler keeps the replicas on different cores (which
    `~phalanx.comm.core_packing` now prevents on a crowded host). Other budgets did not do better in the
    same interleaved runs: sleeping at once 1,595 samples/s against 2,259 for this one (median of
    6 jobs), 20 ms of spin 1,597 against 2,259, 50 ms 1,995 against 3,065 (5 jobs); sleeping after
    50 us when more tasks were runnable than cores, 0.70x the pre-futex wait (5 rounds). Sleeping
    pays for the long waits (a peer that lost its core for a slice, or is seconds late).

    `~phalanx.comm.wait_stats.record_wait_stats` makes every communicator write where its waits went
    (see :class:`~phalanx.comm.wait_stats.WaitStats`).
    """

    def __init__(self, replicas: int) -> None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        self.budget = 0.0 if replicas > cores else _SPIN_S


class _Segment:
    """The mapping and every view of it; released by `ShmAllReduce.close` or at exit."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        self.path: str | None = path if create else None  # only the creator unlinks
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise DistributedRuntimeError(
                    f"Shared segment {path} has the wrong size.", hint="all ranks must pass the same capacity_bytes"
                )
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm: mmap.mmap | None = mmap.mmap(fd, size, flags=flags)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.words = memoryview(self.mm).cast("q")  # counters: fast scalar reads/writes
        self.bytes = np.frombuffer(self.mm, dtype=np.uint8)
        self.views: dict[Any, list[list[np.ndarray]]] = {}

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def release(self) -> None:
        self.unlink()
        if self.mm is None:
            return
        self.views.clear()
        self.bytes = None
        self.words.release()
        try:
            self.mm.close()
        except BufferError:  # a view survives in a traceback; the mapping goes with it
            pass
        self.mm = None


class _Reduction:
    """``out = ((srcs[0] op srcs[1]) op srcs[2]) ...`` (/ world_size for MEAN), in place."""

    def __init__(self, dtype: torch.dtype, op: str, world_size: int) -> None:
        self.dtype, self.world_size, self.mean = dtype, world_size, op == "mean"
        self.ufunc = None if dtype in _TORCH_MATH else _UFUNCS[op]
        self.torch_fn = _TORCH_FNS[op]

    def __call__(self, out: np.ndarray, srcs: list[np.ndarray]) -> None:
        if self.ufunc is not None:
            self.ufunc(srcs[0], srcs[1], out=out)
            for src in srcs[2:]:
                self.ufunc(out, src, out=out)
            if not self.mean:
                return
            if out.dtype.kind == "f":
                np.true_divide(out, self.world_size, out=out)
                return
        # torch math, in pieces that stay on this thread (one piece if torch has one thread)
        piece = max(1, out.size) if torch.get_num_threads() == 1 else _GRAIN
        view = (lambda a: torch.from_numpy(a).view(self.dtype)) if self.dtype == torch.bfloat16 else torch.from_numpy
        for i in range(0, out.size, piece):
            o = view(out[i : i + piece])
            if self.ufunc is None:
                ins = [view(src[i : i + piece]) for src in srcs]
                self.torch_fn(ins[0], ins[1], out=o)
                for t in ins[2:]:
                    self.torch_fn(o, t, out=o)
            if self.mean:
                if o.is_floating_point():
                    o.div_(self.world_size)
                else:
                    o.div_(self.world_size, rounding_mode="trunc")


class ShmAllReduce:
    """All-reduce through shared memory among the ``world_size`` processes of one host.

    All ranks must construct their instances in the same order and call :meth:`all_reduce`
    with tensors of the same numel, dtype and op in the same order, as with any collective
    (a mismatch is detected and raises). One thread per instance at a time.
    Tensors are CPU tensors of dtype float32/64, float16, bfloat16, int8/16/32/64 or uint8.

    Args:
        rank: this process's index among the processes sharing the segment, 0..world_size-1.
        world_size: number of processes; all must run on this host.
        store: a ``torch.distributed.Store`` shared by the processes; used once, to publish
            the segment name and the pids (with the store's own timeout).
        prefix: namespace for store keys and the segment name.
        timeout: seconds any single wait may take before `CollectiveTimeoutError`.
        capacity_bytes: upper bound on the segment's data area, which holds two (parities)
            step buffers per rank. A step moves ``capacity_bytes / (2 * world_size)`` bytes of
            the tensor, capped at a tuned 1 MiB (so the default 16 MiB maps 4 MiB for 2 ranks);
            larger tensors are processed in chunks of that size.
        stats_dir: a directory where, at close, this rank writes its wait statistics (see
            `~phalanx.comm.wait_stats.record_wait_stats`); default: the one it set, if any.
        packing: whether the ranks move onto one core while the host is crowded, and back when
            it calms down (see `~phalanx.comm.core_packing`); default: ``PHALANX_SHM_PACKING``
            (on unless set to 0).

    Example:
        >>> comm = ShmAllReduce(rank, world_size, store)  # doctest: +SKIP
        >>> comm.all_reduce(torch.full((3,), float(rank)), op="max")  # doctest: +SKIP
        tensor([1., 1., 1.])
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        *,
        prefix: str = "phalanx",
        timeout: float = 30.0,
        capacity_bytes: int = 16 << 20,
        stats_dir: str | None = None,
        packing: bool | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size}).")
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self._step = 0
        self._tag = _NO_TAG  # the current call's tag, published beside its signature
        self._closed = False
        self._stats: WaitStats | None = None
        self._placement = Placement(False, 1, enabled=False)
        if world_size == 1:  # nothing to exchange
            self._finalizer = weakref.finalize(self, lambda: None)
            return
        chunk = min(capacity_bytes // (2 * world_size), _MAX_CHUNK_BYTES) // 4096 * 4096
        if chunk <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} is too small; need at least {2 * world_size * 4096}.")
        self._chunk_bytes = chunk
        self._header = -(-(world_size + 1) * _RANK_BYTES // 4096) * 4096  # block 0: magic, world_size
        self._stride = _RANK_BYTES // 8
        size = self._header + 2 * world_size * chunk
        self._seg, self._peers = self._rendezvous(store, prefix, size)
        self._address = self._seg.bytes.ctypes.data  # of the mapping, for the futex calls
        self._spin = _Spin(world_size)
        packing = Settings.from_environ().shm_packing if packing is None else packing
        self._placement = Placement(rank == 0, world_size, enabled=packing, pids=[p for p, _ in self._peers.values()])
        blocks = [(j + 1) * self._stride for j in range(world_size)]
        self._all_times = [(at + _RUN, at + _RUNNABLE) for at in blocks]
        self._times = self._all_times[rank]
        where = stats_dir or wait_stats.stats_dir()
        self._stats = WaitStats(where, rank, world_size, self._spin.budget) if where else None
        if self._stats is not None:
            self._stats.placement = self._placement
        # also runs at exit
        self._finalizer = weakref.finalize(self, _finish, self._seg, self._stats, self._placement)

    # ------------------------------------------------------------------ setup
    def _rendezvous(self, store: Any, prefix: str, size: int) -> tuple[_Segment, dict]:
        """Creates (rank 0) or maps the segment and exchanges pids through the store."""
        rank, n = self.rank, self.world_size
        # Per-rank instance counter in the store: the k-th instance of every rank meets the
        # k-th of the others, and a stale name from an earlier instance is never read.
        base = f"{prefix}/shm/{store.add(f'{prefix}/shm/instances/{rank}', 1)}"
        if rank == 0:
            name = f"{prefix}-shm-{os.getpid()}-{secrets.token_hex(8)}"
            seg = _Segment(os.path.join(_SHM_DIR, name), size, create=True)
        else:
            name = store.get(f"{base}/name").decode()
            try:
                seg = _Segment(os.path.join(_SHM_DIR, name), size, create=False)
            except FileNotFoundError:
                raise DistributedRuntimeError(
                    f"Rank {rank} cannot open shared segment {name!r} in {_SHM_DIR}.",
                    hint="ShmAllReduce needs every rank on one host (and one /dev/shm)",
                ) from None
        try:
            if rank == 0:
                seg.words[1], seg.words[0] = n, _MAGIC
                store.set(f"{base}/name", name)
            elif (seg.words[0], seg.words[1]) != (_MAGIC, n):
                raise DistributedRuntimeError(
                    f"Shared segment {name!r} is not for this job.", hint="all ranks must pass the same world_size"
                )
            store.set(f"{base}/pid/{rank}", f"{os.getpid()} {_start_time(os.getpid())}")
            keys = [f"{base}/pid/{j}" for j in range(n)]
            try:
                store.wait(keys)
            except Exception:
                missing = [f"rank {j}" for j in range(n) if not store.check([keys[j]])]
                if not missing:
                    raise
                raise RendezvousTimeoutError(missing, store.timeout.total_seconds()) from None
            peers = {}
            for j in range(n):
                pid, _, start = store.get(keys[j]).decode().partition(" ")
                peers[j] = (int(pid), start)
        except BaseException:
            seg.release()
            raise
        seg.unlink()  # every rank has mapped it: the kernel frees it with the last mapping
        return seg, peers

    def _regions(self, dtype: Any) -> list[list[np.ndarray]]:
        """Typed views of the data regions, indexed [parity][rank]; cached per numpy dtype."""
        views = self._seg.views.get(dtype)
        if views is None:
            n, chunk, at = self.world_size, self._chunk_bytes, self._header
            views = [
                [self._seg.bytes[at + (p * n + r) * chunk :][:chunk].view(dtype) for r in range(n)] for p in range(2)
            ]
            self._seg.views[dtype] = views
        return views

    # ------------------------------------------------------------------ public API
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", tag: int | None = None) -> torch.Tensor:
        """Reduces ``tensor`` across all ranks, in place, and returns it.

        Args:
            tensor: a CPU tensor of any shape (non-contiguous ones are copied and written back).
            op: "sum", "mean", "max", "min" or "product". MEAN divides the rank-order sum by
                world_size; for integer dtypes it truncates toward zero (as NCCL's ncclAvg).
            tag: an integer published beside the call's signature (the caller's step, say). It
                does not take part in matching the calls: it says, when they do not match, what
                each rank was doing (see ``CollectiveMismatchError``).

        Returns:
            ``tensor``, holding the result, bit-identical on every rank.

        Raises:
            PeerUnavailableError: a peer process exited.
            CollectiveTimeoutError: a peer did not arrive within ``timeout`` seconds.
            CollectiveMismatchError: a tagged call met calls of a different numel/dtype/op; it
                carries every rank's call and tag, and every rank raises it at the same call.
            DistributedRuntimeError: the same for an untagged call, or this instance is closed.
                After any error raised mid-collective the instance is closed.
        """
        key = getattr(op, "value", op)
        key = key.lower() if isinstance(key, str) else key
        if key not in _UFUNCS:
            raise ValueError(f"Unknown reduce op {op!r}; use one of {sorted(_UFUNCS)}.")
        code = _DTYPE_CODES.get(tensor.dtype)
        if code is None or tensor.device.type != "cpu":
            raise TypeError(
                f"ShmAllReduce supports CPU tensors of dtype "
                f"{[str(d) for d in _STORAGE]}; got {tensor.dtype} on {tensor.device}."
            )
        if self._closed:
            raise DistributedRuntimeError("ShmAllReduce is closed.", hint="create a new instance (on every rank)")
        if self.world_size == 1 or tensor.numel() == 0:
            return tensor
        raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        arr = (raw.detach() if raw.requires_grad else raw).numpy()  # shares memory, any strides
        flat = arr.reshape(-1) if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(-1)
        reduce = _Reduction(tensor.dtype, key, self.world_size)
        placement = self._placement
        if placement.enabled:  # once a window: publish, decide (the leader), follow
            words = self._seg.words
            if placement.publish(words, self._times) and placement.leader:
                placement.decide(words, self._all_times, _CHOICE)
            if words[_CHOICE] - 1 != placement.core:
                placement.follow(words[_CHOICE] - 1)
        sig = (flat.size << 8) | (code << 3) | _OP_CODES[key]
        self._tag = _NO_TAG if tag is None else int(tag)
        try:
            with np.errstate(all="ignore"):  # inf/nan propagate silently, as in torch
                if flat.nbytes <= min(_SMALL_MAX_BYTES, self._chunk_bytes):
                    self._small(flat, reduce, sig)
                else:
                    step_elems = self._chunk_bytes // flat.itemsize
                    for c in range(0, flat.size, step_elems):
                        self._large(flat[c : c + step_elems], reduce, sig)
            if not arr.flags.c_contiguous:
                np.copyto(arr, flat.reshape(arr.shape))
        except BaseException:  # mid-collective: our steps no longer match the peers'
            self.close()
            raise
        return tensor

    def close(self) -> None:
        """Unmaps (and, if still linked, unlinks) the segment. Idempotent."""
        self._closed = True
        self._finalizer()

    def abort(self) -> None:
        """Tells every rank still waiting in a collective here that this one has left for good.

        Each raises :class:`~phalanx.errors.PeerUnavailableError` at its next liveness check (within
        100 ms) instead of waiting out the timeout for a rank that is alive but gone elsewhere (an
        elastic job re-forming its group without a dead peer).
        """
        if self.world_size > 1 and not self._closed:
            self._seg.words[_ABORTED] = 1

    # ------------------------------------------------------------------ steps
    def _publish(self, field: int, step: int, sig: int | None = None) -> None:
        if _NEEDS_FENCE:
            os.sched_yield()
        words, stride = self._seg.words, self._stride
        at = (self.rank + 1) * stride
        if sig is not None:
            words[at + _SIG + (step & 1)] = sig
            words[at + _TAG + (step & 1)] = self._tag
        words[at + field] = step
        # A peer that sleeps on this counter is woken; one that is about to sleep sees the new
        # value in the kernel's compare and does not (its bounded sleep covers a lost race).
        for j in range(1, self.world_size + 1):
            if words[j * stride + _SLEEPING] and j != self.rank + 1:
                _FUTEX.wake(self._address + (at + field) * 8 + _LOW_WORD)
                break

    def _small(self, flat: np.ndarray, reduce: _Reduction, sig: int) -> None:
        """Every rank publishes its whole tensor, then reduces all of them in rank order."""
        self._step = step = self._step + 1
        regions = self._regions(flat.dtype)[step & 1]
        n = flat.size
        np.copyto(regions[self.rank][:n], flat)
        self._publish(_ARRIVED, step, sig)
        self._wait(_ARRIVED, step, range(self.world_size), sig)
        reduce(flat, [r[:n] for r in regions])

    def _large(self, x: np.ndarray, reduce: _Reduction, sig: int) -> None:
        """One chunk: reduce-scatter (rank r reduces slice r), then all-gather."""
        self._step = step = self._step + 1
        regions = self._regions(x.dtype)[step & 1]
        rank, n = self.rank, x.size
        align = max(1, _ALIGN // x.itemsize)
        per = -(-n // (self.world_size * align)) * align  # ceil(n / world_size), aligned up
        bounds = [(min(j * per, n), min((j + 1) * per, n)) for j in range(self.world_size)]
        lo, hi = bounds[rank]
        mine = regions[rank]
        # Peers need every slice but ours; ours is reduced straight from `x`.
        np.copyto(mine[:lo], x[:lo])
        np.copyto(mine[hi:n], x[hi:n])
        self._publish(_ARRIVED, step, sig)
        self._wait(_ARRIVED, step, range(self.world_size), sig)
        out = mine[lo:hi]  # unused by the copies above, so no input aliases it
        reduce(out, [x[lo:hi] if j == rank else regions[j][lo:hi] for j in range(self.world_size)])
        self._publish(_REDUCED, step)
        np.copyto(x[lo:hi], out)
        for j, (a, b) in enumerate(bounds):
            if j != rank:
                self._wait(_REDUCED, step, (j,))
                np.copyto(x[a:b], regions[j][a:b])

    # ------------------------------------------------------------------ waiting
    def _wait(self, field: int, step: int, ranks: Any, sig: int | None = None) -> None:
        """Waits until every rank in `ranks` has published `field` >= `step`."""
        words, stride = self._seg.words, self._stride
        field += stride  # skip the header block
        pending = [j for j in ranks if words[j * stride + field] < step]
        if pending:
            stats, budget = self._stats, self._spin.budget
            start = time.perf_counter()
            cpu = time.thread_time() if stats is not None else 0.0
            spin_end = start + budget
            yield_end = start + _YIELD_S
            every = _LIVENESS_S
            check, deadline, nap = start + every, start + self.timeout, _MIN_SLEEP_S
            while pending:
                pending = [j for j in pending if words[j * stride + field] < step]
                if not pending:
                    break
                now = time.perf_counter()
                if now < spin_end:
                    if now - start >= _PURE_SPIN_S:
                        os.sched_yield()  # lets a peer that shares our core run
                    continue
                if now >= check:
                    self._check_peers(pending, now >= deadline)
                    every = min(2 * every, _MAX_LIVENESS_S)
                    check = now + every
                if _FUTEX.available:
                    self._sleep(pending[0] * stride + field, step, min(check, deadline) - now)
                    if stats is not None:
                        stats.sleep(time.perf_counter() - now)
                elif now < yield_end:
                    os.sched_yield()
                else:
                    time.sleep(nap)
                    nap = min(2 * nap, _MAX_SLEEP_S)
            if stats is not None:
                stats.wait(time.perf_counter() - start, time.thread_time() - cpu, budget)
        if _NEEDS_FENCE:
            os.sched_yield()
        if sig is not None:
            slot = stride + _SIG + (step & 1)
            bad = [j for j in ranks if words[j * stride + slot] != sig]
            if bad:
                self._mismatch(bad, sig, step)

    def _sleep(self, slot: int, step: int, timeout: float) -> None:
        """Sleeps until the counter in ``slot`` changes (a peer's wake-up) or ``timeout`` passes."""
        words, mine = self._seg.words, (self.rank + 1) * self._stride + _SLEEPING
        words[mine] = 1
        try:
            value = words[slot]
            if value < step:  # re-read after raising the flag: a publish before it is not missed
                low = value & 0xFFFFFFFF
                _FUTEX.wait(self._address + slot * 8 + _LOW_WORD, low - (1 << 32) if low >> 31 else low, timeout)
        finally:
            words[mine] = 0

    def _mismatch(self, bad: list[int], sig: int, step: int) -> None:
        """Raises the error of calls that do not match, naming every rank's call.

        The slots read here are stable: no rank can publish step ``step + 2`` (same parity)
        before every rank has passed this step's check, which raises on every rank alike.
        """
        words, stride, parity = self._seg.words, self._stride, step & 1
        if self._tag == _NO_TAG:
            raise DistributedRuntimeError(
                f"shm all_reduce: ranks {bad} passed a different numel/dtype/op than rank "
                f"{self.rank} (numel={sig >> 8}).",
                hint="call all_reduce with the same tensor shape, dtype and op on every rank",
            )
        dtypes, ops = list(_STORAGE), list(_UFUNCS)
        calls = []
        for j in range(self.world_size):
            theirs = words[(j + 1) * stride + _SIG + parity]
            tag = words[(j + 1) * stride + _TAG + parity]
            code = (theirs >> 3) & 31
            calls.append(
                {
                    "numel": theirs >> 8,
                    "dtype": str(dtypes[code]).removeprefix("torch.") if code < len(dtypes) else f"code {code}",
                    "op": ops[theirs & 7] if (theirs & 7) < len(ops) else f"code {theirs & 7}",
                    "tag": None if tag == _NO_TAG else tag,
                }
            )
        raise CollectiveMismatchError("shm all_reduce", self.rank, calls)

    def _check_peers(self, pending: list[int], expired: bool) -> None:
        if self._seg.words[_ABORTED]:
            raise PeerUnavailableError(
                [f"rank {j}" for j in pending],
                step=None,
                operation="shm all_reduce",
                cause="a rank left this group (it is re-forming without a lost peer)",
            )
        dead = [j for j in pending if not _alive(*self._peers[j])]
        if dead:
            raise PeerUnavailableError(
                [f"rank {j}" for j in dead],
                step=None,
                operation="shm all_reduce",
                cause=f"process {', '.join(str(self._peers[j][0]) for j in dead)} exited",
            )
        if expired:
            raise CollectiveTimeoutError(
                [f"rank {j}" for j in pending],
                step=None,
                operation="shm all_reduce",
                cause=f"alive but did not arrive within {self.timeout:g}s",
            )
