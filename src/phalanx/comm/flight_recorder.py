"""The flight recorder: a ring of this replica's last collectives, kept at a few attribute writes each.

Every collective the communicator runs (shared memory, gloo or NCCL) takes the next slot of a
fixed ring (``PHALANX_FLIGHT_RECORDER`` slots, default 128, a power of two): its sequence number, the operation
(``all_reduce``, ``broadcast``, ...), what it is for (``kind``: a gradient bucket, ``reduce``,
``gather``, a barrier, the guard, variable sync; the operation's name when nobody said), its size
and dtype, the step, the user's source line that caused it, and when it started and ended (``end``
stays 0 while it is in flight). When a job hangs or its replicas' collectives part, the ring says
where each replica is and where their histories differ (:mod:`phalanx.comm.diagnosis`).

Cost. A collective writes one tuple and two list slots, and nothing else: no lock, no stack walk
(``python -m benchmarks.flight_recorder`` measures it; ``benchmarks/results/flight_recorder.json``); on a GPU it reads
only the tensor's ``numel`` and ``dtype``, which never wait for the device. The source line is
found once per API call: an entry point (``strategy.reduce``, ``gather``, ``barrier``, the guard,
each ``strategy.run`` step) clears it, and the first collective after that walks the stack to the
first frame outside phalanx, torch and Keras and keeps it for the collectives that follow in the
same call (a step's gradient buckets share the line of its ``loss.backward()``). A walk from a
thread with no user frame (autograd's device threads on GPUs) falls back to the frame that called
``strategy.run``.

Example:
    >>> import torch
    >>> rec = FlightRecorder(capacity=4)
    >>> with rec.label("reduce"):
    ...     slot = rec.begin("all_reduce", torch.ones(3), step=1, start=0.5)
    ...     rec.ends[slot] = 0.75
    >>> [(r["seq"], r["kind"], r["numel"], r["dtype"], r["step"]) for r in rec.to_json()]
    [(1, 'reduce', 3, 'float32', 1)]
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import time
from types import FrameType
from typing import Any

__all__ = ["FlightRecorder", "library_frame", "record_to_dict", "recording", "user_site"]

DEFAULT_CAPACITY = 128
# Modules whose frames are not "the user's line": phalanx itself, the libraries it drives, and the
# stdlib's wrappers that sit between a user's call and phalanx (a `with`, a partial, a thread's start).
_LIBRARIES = frozenset(
    {"phalanx", "torch", "keras", "contextlib", "functools", "numpy", "optree", "tree", "threading", "runpy"}
)
# A site nobody could find (no user frame on this thread): looked up once, then kept as it is.
NO_SITE: tuple = ()
# `site` outside any entry point: walk for every collective there (rare ones: a checkpoint's
# coordination, variable sync at scope exit), never keep one that later collectives would inherit.
_EVERY_TIME = ("every time",)


def library_frame(frame: FrameType) -> bool:
    """Whether ``frame`` runs phalanx's, torch's or Keras' code (or a stdlib wrapper between them)."""
    name = frame.f_globals.get("__name__") or ""
    return name.partition(".")[0] in _LIBRARIES


def user_site(frame: FrameType | None, fallback: FrameType | None = None) -> tuple:
    """``(file, line, function)`` of the first frame from ``frame`` outwards that is the user's.

    Args:
        frame: where to start (the collective's own frame, say).
        fallback: where to look when ``frame``'s thread has no user frame (autograd's device
            threads on GPUs): the frame that called ``strategy.run``.

    Returns:
        The site, or ``NO_SITE`` when neither has a user frame.
    """
    for start in (frame, fallback):
        f = start
        while f is not None:
            if not library_frame(f):
                return (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
            f = f.f_back
    return NO_SITE


def source_of(site: tuple | list) -> str:
    """The source text of a site's line, stripped ('' when it cannot be read)."""
    if not site:
        return ""
    return linecache.getline(site[0], site[1]).strip()


def record_to_dict(entry: tuple, end: float, error: str | None, wall_offset: float) -> dict[str, Any]:
    """One ring entry as JSON: times as wall-clock seconds (``perf_counter`` + ``wall_offset``), the
    site with its source text, ``end`` None while the collective is in flight."""
    seq, op, kind, numel, dtype, step, site, start = entry
    site = list(site)
    if site:
        site.append(source_of(site))
    return {
        "seq": seq,
        "op": op,
        "kind": kind or op,
        "numel": numel,
        "dtype": str(dtype).removeprefix("torch."),
        "step": step,
        "site": site,
        "start": start + wall_offset,
        "end": end + wall_offset if end else None,
        "error": error,
    }


class _Label:
    """``with recorder.label(kind):``: the collectives inside are ``kind``, from the caller's line."""

    __slots__ = ("_rec", "_kind", "_saved")

    def __init__(self, rec: FlightRecorder, kind: str) -> None:
        self._rec, self._kind = rec, kind

    def __enter__(self) -> None:
        rec = self._rec
        self._saved = (rec.kind, rec.site)
        rec.kind, rec.site = self._kind, None

    def __exit__(self, *exc: object) -> None:
        self._rec.kind, self._rec.site = self._saved


class FlightRecorder:
    """The ring of one communicator's last ``capacity`` collectives (see the module docstring).

    A collective's entry is one tuple ``(seq, op, kind, numel, dtype, step, site, start)`` in the
    ring, and its end time a float in the parallel list ``ends`` (0.0 while in flight), which the
    communicator writes when the collective ends: one tuple and two list stores per collective.

    Attributes:
        seq: the number of collectives started so far (the last one's sequence number).
        ends: end times (``perf_counter``) by slot; the caller writes ``ends[slot]``.
        kind: what the collectives started now are for (set by :meth:`label`; None: the operation).
        site: their user source line; None until the first collective looks it up.
        caller: the frame that called ``strategy.run`` during a step (the fallback of the lookup).
        busy: what this replica declared it is doing alone (``phalanx.wait_for_chief``), or None.
    """

    __slots__ = (
        "seq",
        "kind",
        "site",
        "caller",
        "busy",
        "capacity",
        "ends",
        "_ring",
        "_mask",
        "_errors",
        "wall_offset",
    )

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        size = 8
        while size < int(capacity):
            size *= 2  # a power of two: the slot is seq & mask
        self.capacity = size
        self._ring: list[tuple | None] = [None] * size
        self.ends = [0.0] * size
        self._mask = size - 1
        self._errors: dict[int, str] = {}  # seq -> how it failed (rare: only failures write here)
        self.seq = 0
        self.kind: str | None = None
        self.site: tuple | None = _EVERY_TIME
        self.caller: FrameType | None = None
        self.busy: dict[str, Any] | None = None
        # perf_counter -> wall clock, so that replicas' (and hosts') times can be put side by side.
        self.wall_offset = time.time() - time.perf_counter()

    # ------------------------------------------------------------------ the hot path
    def begin(self, op: str, tensor: Any, step: int | None, start: float) -> int:
        """Records a collective that starts now; returns its slot (the caller writes ``ends[slot]``)."""
        seq = self.seq = self.seq + 1
        site = self.site
        if site is None or site is _EVERY_TIME:
            found = user_site(sys._getframe(1), self.caller)
            if site is None:
                self.site = found
            site = found
        slot = seq & self._mask
        self._ring[slot] = (seq, op, self.kind, tensor.numel(), tensor.dtype, step, site, start)
        self.ends[slot] = 0.0
        return slot

    def failed(self, slot: int, error: BaseException) -> None:
        """Marks the collective in ``slot`` as failed (its end is when it failed)."""
        entry = self._ring[slot]
        if entry is not None:
            self._errors[entry[0]] = type(error).__name__
            if len(self._errors) > self.capacity:
                self._errors.pop(next(iter(self._errors)))
        self.ends[slot] = time.perf_counter()

    # ------------------------------------------------------------------ entry points
    def label(self, kind: str) -> _Label:
        """A context manager: the collectives inside are ``kind`` and come from the caller's line."""
        return _Label(self, kind)

    def labelled(self, kind: str, fn: Any) -> Any:
        """``fn`` with its collectives recorded as ``kind``: a strategy's gradient-bucket function.

        One attribute write per call and no restore (a bucket is a hot path): ``kind`` stays until
        the step ends (:meth:`leave_step`) or an entry point's :meth:`label` sets and restores its own;
        every other collective of a step comes through such an entry point.
        """

        def call(*args: Any) -> Any:
            self.kind = kind
            return fn(*args)

        return call

    def enter_step(self, caller: FrameType | None) -> tuple:
        """A ``strategy.run`` step begins: its collectives look their line up afresh; returns what to restore."""
        saved = (self.kind, self.site, self.caller)
        self.kind, self.site, self.caller = None, None, caller
        return saved

    def leave_step(self, saved: tuple) -> None:
        self.kind, self.site, self.caller = saved

    # ------------------------------------------------------------------ reading
    def entries(self) -> list[tuple[tuple, float, str | None]]:
        """``(entry, end, error)`` of the recorded collectives, oldest first (at most ``capacity``)."""
        out = []
        for seq in range(max(1, self.seq - self.capacity + 1), self.seq + 1):
            slot = seq & self._mask
            entry = self._ring[slot]
            if entry is not None and entry[0] == seq:
                out.append((entry, self.ends[slot], self._errors.get(seq)))
        return out

    def current(self) -> tuple | None:
        """The entry of the collective in flight (started, neither ended nor failed), if any."""
        slot = self.seq & self._mask
        entry = self._ring[slot]
        if entry is None or self.ends[slot] or entry[0] in self._errors:
            return None
        return entry

    def to_json(self) -> list[dict[str, Any]]:
        """Every recorded collective as JSON (:func:`record_to_dict`), oldest first."""
        return [record_to_dict(e, end, err, self.wall_offset) for e, end, err in self.entries()]


def recording(comm: Any, kind: str) -> contextlib.AbstractContextManager[None]:
    """``with recording(comm, "reduce"):`` labels the collectives inside (and looks their line up
    afresh); a communicator without a recorder (one replica, threaded ranks) records nothing."""
    rec = getattr(comm, "recorder", None)
    return rec.label(kind) if rec is not None else contextlib.nullcontext()
