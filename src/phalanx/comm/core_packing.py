"""Where a host's replicas run: spread over its cores, or packed on one while the host is crowded.

Why. Replicas that all-reduce every step make progress together or not at all. On a host where
other programs want the cores too (a busy process per core, DataLoader workers, a second job), the
kernel shares each core fairly among what is runnable on it, and replicas spread over two cores
each get a slice of their own core, at different moments: the first to reach the all-reduce sleeps,
and its core goes to the neighbour, not to the peer it waits for. On a 2-core VM under one busy
process per core and a DataLoader with 2 workers (``python -m benchmarks.load_diag``, issue 33), the
large MLP's two replicas ran 1,880 samples/s (median of 16 jobs, 555 at worst) while the kernel kept
them on different cores and 3,062 when it happened to keep them on one; pinned to one core they
held 3,061-3,386 in every job, and DDP's replicas showed the same split (1,835 and 2,813). On one
core, a replica that waits hands the core to its peer, and the job keeps what it was given. On an
idle host, packing would halve the speed: so it follows the load.

Policy. The leader (local rank 0) decides once per window (``_WINDOW_S``) from what every rank
publishes in the shared segment, its compute thread's time running and time waiting runnable
(``/proc/thread-self/schedstat``), and, while packed, the idle time of the host's other cores
(``/proc/stat``):

- spread → packed when the replicas together ran less than ``_PACK_BELOW`` of a core while each
  waited runnable at least ``_CROWDED`` of the window: the host took more from the job than a
  core of its own would. A job that is merely idle (waiting for input, or for a slow peer on
  another host) waits asleep, not runnable, and is not packed.
- packed → spread when the other cores (of the replicas' own affinity mask) sat idle for at
  least ``_UNPACK_IDLE`` of a core for ``_UNPACK_WINDOWS`` windows in a row: a core is free again.

Each rank applies the leader's choice at its next all-reduce, to every thread of its process, and
puts its own mask back when the host calms down, at close, and in a child it forks (so a DataLoader
worker started while packed runs anywhere). A process started another way while packed
(``subprocess``, multiprocessing's spawn or forkserver) inherits the one-core mask from the
kernel; each rank gives its descendants whose mask is exactly the packed core (the job's other
replicas aside) the original mask back at its first all-reduce of the next window, and when it
spreads or closes. ``PHALANX_SHM_PACKING=0`` turns packing off.

Example (what `~phalanx.comm.shm.ShmAllReduce` does at each all-reduce, on every rank)::

    placement = Placement(leader=rank == 0, replicas=world_size)  # once
    if placement.publish(words, my_slots) and placement.leader:    # once a window
        placement.decide(words, all_slots, CHOICE)                 # writes a new choice, if any
    placement.follow(words[CHOICE] - 1)                            # moves the threads if it changed
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Sequence
from typing import Any

__all__ = ["SPREAD", "Placement", "decide"]

SPREAD = -1  # no core chosen: every rank runs on its own affinity mask

_WINDOW_S = 0.25  # how often the leader decides; a step of the large MLP under load takes ~0.1 s
_PACK_BELOW = 0.9  # pack when the replicas together ran less than this many cores ...
_CROWDED = 0.3  # ... while each waited runnable at least this share of the window
_UNPACK_IDLE = 0.5  # spread again when the other cores sat idle this many cores' worth ...
_UNPACK_WINDOWS = 2  # ... in this many windows in a row


def decide(
    packed: bool,
    run_s: Sequence[float],
    runnable_s: Sequence[float],
    others_idle_s: float,
    window_s: float,
    calm_windows: int,
) -> tuple[bool, int]:
    """The policy alone: whether the replicas should be packed after this window.

    Args:
        packed: whether they are packed now.
        run_s: each replica's compute thread's time on a core during the window.
        runnable_s: each one's time runnable but waiting for a core.
        others_idle_s: idle time of the cores other than the packed one (0 when spread).
        window_s: the window's length.
        calm_windows: windows in a row, before this one, that found a free core while packed.

    Returns:
        ``(packed, calm_windows)`` after this window.

    Example:
        >>> decide(False, [0.05, 0.06], [0.15, 0.16], 0.0, 0.25, 0)  # crowded: each ran 1/5
        (True, 0)
        >>> decide(False, [0.23, 0.22], [0.0, 0.01], 0.0, 0.25, 0)  # idle host: stay spread
        (False, 0)
        >>> decide(True, [0.1, 0.1], [0.1, 0.1], 0.2, 0.25, 1)  # the other core is free again
        (False, 0)
    """
    if window_s <= 0 or not run_s:
        return packed, calm_windows
    if not packed:
        crowded = min(runnable_s) >= _CROWDED * window_s
        return crowded and sum(run_s) < _PACK_BELOW * window_s, 0
    calm = calm_windows + 1 if others_idle_s >= _UNPACK_IDLE * window_s else 0
    return (False, 0) if calm >= _UNPACK_WINDOWS else (True, calm)


def _schedstat() -> tuple[int, int]:
    """This thread's nanoseconds on a core and runnable waiting for one (schedstat(5))."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            run, wait, _ = f.read().split(maxsplit=2)
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


_clock = time.perf_counter  # a name of its own, so tests can play the windows


_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def _idle_s(cores: Sequence[int]) -> float:
    """Seconds the given cores have been idle since boot (idle + iowait of ``/proc/stat``)."""
    wanted, total = {f"cpu{c}" for c in cores}, 0
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0].decode() in wanted:
                    total += int(fields[4]) + int(fields[5])
    except (OSError, ValueError, IndexError):
        return 0.0
    return total * _TICK_S


def _current_core() -> int | None:
    """The core this thread runs on now (field 39 of ``/proc/thread-self/stat``)."""
    try:
        with open("/proc/thread-self/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def _descendants() -> list[int]:
    """The process ids of this process's children, theirs, and so on (``/proc/.../children``)."""
    found: list[int] = []
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


def _free_descendants(core: int, mask: set[int], replicas: Collection[int] = ()) -> None:
    """Gives ``mask`` back to every descendant thread whose mask is exactly ``{core}``: a process
    started while packed (subprocess, spawn, forkserver), which inherited the packed mask.

    The processes in ``replicas`` are left alone: a job that starts its replicas itself
    (``python train.py``, `phalanx.launch.self_launch`) has replica 1 as a child of replica 0, and
    that child is packed on purpose."""
    for pid in _descendants():
        if pid in replicas:
            continue
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                if os.sched_getaffinity(tid) == {core}:
                    os.sched_setaffinity(tid, mask)
            except OSError:  # exited, or not ours to change
                pass


def _set_threads(mask: set[int]) -> None:
    """Gives every thread of this process the affinity ``mask``; threads gone meanwhile are skipped."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:  # exited, or a mask this thread may not take
            pass


_FORK_HOOK: list[set[int] | None] = [None]  # the mask a forked child gets back, while packed
# The one Placement of this process that may move its threads: a second communicator's leader
# (created while the first one lives) could otherwise choose differently, and the two would take
# turns moving the same threads.
_OWNER: list[Placement | None] = [None]


def _child_after_fork() -> None:
    mask, _FORK_HOOK[0] = _FORK_HOOK[0], None
    if mask is not None:
        try:
            os.sched_setaffinity(0, mask)
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_child_after_fork)


class Placement:
    """One rank's side of the policy: publishes its times, applies the leader's choice.

    The shared words are the caller's (the segment of `~phalanx.comm.shm.ShmAllReduce`): for each
    rank two int64 slots that only it writes (nanoseconds run and runnable), and one word that
    only the leader writes, the chosen core plus one (0: spread).

    Args:
        leader: whether this rank decides (local rank 0).
        replicas: the number of ranks on this host.
        enabled: False keeps every rank on its own mask (``PHALANX_SHM_PACKING=0``).
        window_s: seconds between two decisions (and two publications).
        pids: the process ids of this host's ranks, which follow the leader's choice themselves
            and are never given a mask back by another rank.
    """

    def __init__(
        self,
        leader: bool,
        replicas: int,
        enabled: bool = True,
        window_s: float = _WINDOW_S,
        pids: Collection[int] = (),
    ) -> None:
        self.pids = frozenset(pids)
        try:
            self.mask: set[int] | None = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux: nothing to place
            self.mask = None
        self.enabled = bool(enabled and self.mask is not None and len(self.mask) >= 2 and replicas >= 2)
        if self.enabled:
            if _OWNER[0] is None:
                _OWNER[0] = self
            else:
                self.enabled = False
        self.leader, self.window_s = leader, window_s
        self.core = SPREAD  # where this rank's threads are now
        self.packs = 0  # times this rank moved onto one core
        self.packed_s = 0.0  # time spent packed (up to the last move)
        self._packed_at = 0.0
        self._next = _clock() + window_s
        self._last: tuple[float, list[tuple[int, int]], float] | None = None  # the leader's last sample
        self._calm = 0

    def publish(self, words: Any, slots: tuple[int, int]) -> bool:
        """Writes this thread's schedstat times into its two ``slots`` once per window.

        While packed, it also frees the descendants that inherited the packed mask. Returns True
        when a window has passed (the leader then decides).
        """
        now = _clock()
        if not self.enabled or now < self._next:
            return False
        self._next = now + self.window_s
        words[slots[0]], words[slots[1]] = _schedstat()
        if self.core != SPREAD and self.mask is not None:
            _free_descendants(self.core, self.mask, self.pids)
        return True

    def decide(self, words: Any, slots: Sequence[tuple[int, int]], choice_slot: int) -> None:
        """The leader: reads every rank's times, and writes a new choice into ``choice_slot``."""
        now = _clock()
        sample = [(words[a], words[b]) for a, b in slots]
        core = words[choice_slot] - 1
        others = sorted(self.mask - {core}) if core != SPREAD and self.mask else []
        idle = _idle_s(others) if others else 0.0
        last, self._last = self._last, (now, sample, idle)
        if last is None:
            return
        then, before, idle_before = last
        run = [(a - b) / 1e9 for (a, _), (b, _) in zip(sample, before, strict=True)]
        runnable = [(a - b) / 1e9 for (_, a), (_, b) in zip(sample, before, strict=True)]
        if any(x < 0 for x in run + runnable) or (0, 0) in before:  # a rank had not published yet
            return
        packed, self._calm = decide(core != SPREAD, run, runnable, max(0.0, idle - idle_before), now - then, self._calm)
        if packed and core == SPREAD:
            # The core the leader runs on: the kernel put it there knowing every core's load. (The
            # core with the fewest other runnable programs in a /proc snapshot was tried, issue 33;
            # its only A/B run is not evidence either way, see docs/performance.md.)
            here = _current_core()
            words[choice_slot] = 1 + (here if here in self.mask else min(self.mask))
            self._last = None  # the next window starts from the new placement
        elif not packed and core != SPREAD:
            words[choice_slot] = 0
            self._last = None

    def follow(self, core: int) -> None:
        """Moves this process's threads onto ``core`` (or back to their mask for `SPREAD`)."""
        if core == self.core or not self.enabled or (core != SPREAD and core not in self.mask):
            return
        now = _clock()
        if core == SPREAD:
            self.packed_s += now - self._packed_at
            _FORK_HOOK[0] = None
            _set_threads(self.mask)
        else:
            if self.core == SPREAD:
                self._packed_at = now
                self.packs += 1
            _FORK_HOOK[0] = set(self.mask)
            _set_threads({core})
        if self.core != SPREAD:  # what was started on the core it leaves goes free now
            _free_descendants(self.core, self.mask, self.pids)
        self.core = core

    def packed_seconds(self) -> float:
        """Time this rank has spent packed so far."""
        return self.packed_s + (_clock() - self._packed_at if self.core != SPREAD else 0.0)

    def restore(self) -> None:
        """Back to the mask this rank had, for good (at close, and when the communicator fails)."""
        self.follow(SPREAD)
        if _OWNER[0] is self:
            _OWNER[0] = None
        self.enabled = False
