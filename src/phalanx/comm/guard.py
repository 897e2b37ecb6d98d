"""A consistency check that rides on the gradient all-reduce: replicas cannot drift apart silently.

Each replica adds a few numbers to the first bucket of every gradient all-reduce (and to the
all-reduces of ``strategy.reduce``): its step, the global batch size it is slicing, the ordinal of
the batch it was given and, at the first step, after a restore and then every ``every`` steps
(``PHALANX_FINGERPRINT_EVERY``), a fingerprint of the synchronised parameters: a replica whose
update differs (another learning rate, a corrupted step) is named within that many steps.

Because the collective is a SUM, each replica writes its numbers into its own *slot* of a vector
that is zero elsewhere: after the sum every replica holds every replica's numbers, exactly (adding
zeros is exact in floating point), so every replica sees the same disagreement at the same
collective and raises the same :class:`~phalanx.errors.ReplicaDivergenceError`. No extra message is
sent, and no extra wait.

Values are integers below 2**24, exactly representable in float32; in 16-bit dtypes each value is
written as three base-256 digits (bfloat16 holds integers up to 256 exactly).

On a GPU nothing of this waits for the device: this replica's fields go to the bucket from one of
two pinned host buffers used in turn (:class:`_Staging`), the parameter fingerprint is computed on
the device in a few kernels over all parameters at once (:func:`fingerprint_tensor`) and written
into the bucket there, and the sum is copied back to pinned memory and read at the next pass
(:meth:`ReplicaGuard.check_pending`). Even so those copies cost host time a short GPU step feels,
so on a GPU the fields ride every ``GUARD_EVERY_GPU``-th pass (:meth:`ReplicaGuard.rides`). So a
divergence is named at once on a CPU and up to ``GUARD_EVERY_GPU`` passes late on a GPU (plus the
pass that reads the sum), and a parameter divergence within ``every`` steps (plus as many).

Example (two replicas, as the sum would combine their vectors)::

    >>> import torch
    >>> g0, g1 = FieldGuard(0, 2), FieldGuard(1, 2)
    >>> total = g0.encode((5, 32, 5, 0), torch.float32) + g1.encode((5, 32, 5, 0), torch.float32)
    >>> g0.check(total, lambda r: f"replica:{r}")  # agreement: returns quietly
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx.comm.flight_recorder import recording
from phalanx.config import GUARD_EVERY_GPU
from phalanx.errors import ReplicaDivergenceError

FIELDS = ("step", "global batch size", "batch", "parameters")
_LIMIT = 1 << 24
_WIDE = {torch.float32: 1, torch.float64: 1, torch.int32: 1, torch.int64: 1}
_NARROW = {torch.float16: 3, torch.bfloat16: 3}


def digits_for(dtype: torch.dtype) -> int | None:
    """How many slots one value takes in ``dtype``; None where the guard cannot ride on it."""
    return _WIDE.get(dtype) or _NARROW.get(dtype)


class FieldGuard:
    """Encodes this replica's fields into its slot, and compares every replica's after the sum.

    Args:
        rank: this replica's index.
        world_size: the number of replicas.
    """

    __slots__ = ("_buffers", "_staging", "_width", "rank", "world_size")

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._width = len(FIELDS)
        # dtype -> a zero vector whose numpy view we write our slot into (it is copied by the
        # torch.cat that builds the bucket, so reusing it is safe): ~1 us instead of ~20 us for
        # building a tensor from a list on every step.
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, object]] = {}
        self._staging = _Staging()

    def size(self, dtype: torch.dtype) -> int:
        """Elements the guard appends to a tensor of ``dtype``."""
        return self.world_size * self._width * (digits_for(dtype) or 0)

    def encode(self, values: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A vector, zero but in this replica's slot, that sums to every replica's values."""
        digits = digits_for(dtype) or 1
        mine = self._row(values, digits)
        if digits == 1 and (device == "cpu" or getattr(device, "type", None) == "cpu"):
            cached = self._buffers.get(dtype)
            if cached is None:
                buffer = torch.zeros(self.world_size * len(mine), dtype=dtype)
                cached = self._buffers[dtype] = (buffer, buffer.numpy())
            at = self.rank * len(mine)
            cached[1][at : at + len(mine)] = mine  # type: ignore[index]
            return cached[0]
        out = [0] * (self.world_size * len(mine))
        at = self.rank * len(mine)
        out[at : at + len(mine)] = mine
        host = torch.tensor(out, dtype=dtype)
        if torch.device(device).type == "cuda":
            # From pinned memory without waiting: a plain copy to the GPU would stall the host until
            # the GPU reached this point of the step (backward so far), on every step.
            return host.pin_memory().to(device, non_blocking=True)
        return host.to(device)

    def _row(self, values: Sequence[int], digits: int) -> list[int]:
        mine: list[int] = []
        for v in values:
            v = int(v) % _LIMIT
            if digits == 1:
                mine.append(v)
            else:
                mine += [(v >> 16) & 0xFF, (v >> 8) & 0xFF, v & 0xFF]
        return mine

    def write(self, values: Sequence[int], out: torch.Tensor) -> None:
        """Writes the vector :meth:`encode` would return into ``out`` (a view of a bucket, any device).

        On the CPU, in place through numpy (wide dtypes). Elsewhere from a pinned host buffer
        without waiting for the device (see :class:`_Staging`): the host never waits for the GPU.
        """
        digits = digits_for(out.dtype) or 1
        mine = self._row(values, digits)
        at = self.rank * len(mine)
        if out.device.type == "cpu" and digits == 1:
            view = out.numpy()
            view[:] = 0
            view[at : at + len(mine)] = mine
            return
        host, array = self._staging.take(out.numel(), out.device)
        array[:] = 0
        array[at : at + len(mine)] = mine
        out.copy_(host, non_blocking=True)
        self._staging.copied(out.device)

    def place(self, field: int, value: torch.Tensor, out: torch.Tensor) -> None:
        """Writes ``value`` (an int64 tensor on ``out``'s device) as this replica's field ``field``
        of ``out``, on the device: no value comes to the host (the device-side fingerprint)."""
        digits = digits_for(out.dtype) or 1
        at = (self.rank * self._width + field) * digits
        if digits == 1:
            out[at : at + 1].copy_(value.reshape(1))
        else:
            out[at : at + 3].copy_(torch.stack([(value >> 16) & 0xFF, (value >> 8) & 0xFF, value & 0xFF]))

    def decode(self, summed: torch.Tensor) -> list[list[int]]:
        """Every replica's values, one row per replica."""
        digits = digits_for(summed.dtype) or 1
        raw = [int(x) for x in summed.tolist()]
        if digits > 1:
            raw = [(raw[i] << 16) | (raw[i + 1] << 8) | raw[i + 2] for i in range(0, len(raw), 3)]
        w = self._width
        return [raw[r * w : (r + 1) * w] for r in range(self.world_size)]

    def check(
        self,
        summed: torch.Tensor,
        name: Callable[[int], str],
        step: int | None = None,
        on_parameters: Callable[[int], str | None] | None = None,
    ) -> None:
        """Raises :class:`ReplicaDivergenceError` if any replica's row differs from this replica's.

        Args:
            summed: the guard's part of the all-reduced tensor.
            name: a replica's name from its rank.
            step: this replica's step, for the message.
            on_parameters: called with the other rank when the parameter fingerprints differ;
                returns the first differing parameter (it may run a collective: every replica
                calls it at the same point, since every replica sees the same rows).

        Raises:
            ReplicaDivergenceError: naming the two replicas, the field and both values.
        """
        flat = summed.tolist()  # the usual case, every row alike, in one conversion and a few list compares
        w = len(flat) // self.world_size
        head = flat[:w]
        if all(flat[i : i + w] == head for i in range(w, len(flat), w)):
            return
        rows = self.decode(summed)
        first = rows[0]
        for r, row in enumerate(rows):
            if row == first:
                continue
            # Compare against replica 0 so every replica reports the same pair.
            for i, (a, b) in enumerate(zip(first, row)):
                if a != b:
                    field = FIELDS[i]
                    parameter = on_parameters(r) if field == "parameters" and on_parameters else None
                    if field == "parameters" and 0 in (a, b):
                        values: tuple = (
                            "not fingerprinted" if a == 0 else f"fingerprint {a:06x}",
                            "not fingerprinted" if b == 0 else f"fingerprint {b:06x}",
                        )
                    elif field == "parameters":
                        values = (f"fingerprint {a:06x}", f"fingerprint {b:06x}")
                    else:
                        values = (a, b)
                    # Replica 0's step, so every replica's message is the same.
                    raise ReplicaDivergenceError(field, (name(0), name(r)), values, step=first[0], parameter=parameter)


class _Staging:
    """Two host buffers used in turn for the guard's copies to a device, so that the host never waits.

    A copy from pinned memory returns before the device has made it; the buffer may be written
    again only once it has. Each buffer's last copy is marked with an event, and a buffer is taken
    again only after its event (two passes ago: long done, so the wait is a query). On the CPU the
    buffers are plain memory and the copies happen at once.
    """

    __slots__ = ("_buffers", "_events", "_turn")

    def __init__(self) -> None:
        self._buffers: list[tuple[torch.Tensor, object] | None] = [None, None]
        self._events: list[object | None] = [None, None]
        self._turn = 0

    def take(self, n: int, device: torch.device) -> tuple[torch.Tensor, object]:
        """The next buffer (float32, ``n`` elements) and its numpy view, free to be written."""
        self._turn = turn = 1 - self._turn
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
        held = self._buffers[turn]
        if held is None or held[0].numel() != n:
            host = torch.zeros(n, dtype=torch.float32, pin_memory=device.type == "cuda")
            held = self._buffers[turn] = (host, host.numpy())
        return held

    def copied(self, device: torch.device) -> None:
        """Marks the buffer last taken as being copied from (on ``device``'s current stream)."""
        if device.type == "cuda":
            event = self._events[self._turn]
            if event is None:
                event = self._events[self._turn] = torch.cuda.Event()
            event.record()  # type: ignore[attr-defined]


_CHUNK = 1 << 22  # elements per position-weighted sum: its int64 temporaries stay at 32 MiB
_MOD = (1 << 24) - 3  # a prime below 2**24: every partial result stays an exact small integer
_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def fingerprint_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 24-bit fingerprint (1 to 2**24 - 1) of ``tensors``' bits, as an int64 tensor on their device.

    Computed on the device in a few kernels whatever the number of tensors: each group of one
    element size is concatenated once, as integers, then summed plainly and weighted by position
    (in chunks, so the int64 temporaries stay small). Integer sums are exact and independent of
    the order of summation, so replicas holding the same bits get the same value; a flipped bit or
    two swapped elements change it. Nothing is read back to the host.

    Example:
        >>> a = [torch.ones(3), torch.zeros(2)]
        >>> int(fingerprint_tensor(a)) == int(fingerprint_tensor([t.clone() for t in a]))
        True
        >>> int(fingerprint_tensor(a)) == int(fingerprint_tensor([torch.zeros(2), torch.ones(3)]))
        False
    """
    groups: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.element_size()), []).append(t.detach().reshape(-1))
    device = tensors[0].device if tensors else torch.device("cpu")
    # The tensors' order, dtypes and shapes (tensors of different element sizes are summed apart).
    layout = zlib.crc32(repr([(str(t.dtype), tuple(t.shape)) for t in tensors]).encode()) % _MOD
    h = torch.full((), layout, dtype=torch.int64, device=device)
    offset = 0
    for (where, size), parts in groups.items():
        flat = torch.cat([p.view(_INTS[size]) for p in parts])
        n = flat.numel()
        plain = flat.sum(dtype=torch.int64)
        weighted = torch.zeros((), dtype=torch.int64, device=where)
        for start in range(0, n, _CHUNK):
            chunk = flat[start : start + _CHUNK].to(torch.int64)
            position = torch.arange(offset + start + 1, offset + start + 1 + chunk.numel(), device=where)
            weighted += (chunk * position).sum()
        offset += n
        for part in (plain, weighted):
            h = (h * 1_000_003 + part.to(device).remainder(_MOD)).remainder(_MOD)
    return h.remainder((1 << 24) - 1) + 1


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Two integers (an int64 pair on ``t``'s device) that change with any bit of ``t``; exact and
    independent of summation order.

    The bits are summed as integers (wrapping modulo 2**64 is associative), once plainly and once
    weighted by position, so a flipped bit or two swapped elements both change the result.
    """
    flat = t.detach().reshape(-1)
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()]
    v = flat.view(ints)
    w = torch.arange(1, v.numel() + 1, device=v.device, dtype=torch.int64)
    return torch.stack([v.sum(dtype=torch.int64), (w * v).sum()])


def digests(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """:func:`_digest` of each tensor, read back with one copy per device (one GPU sync, not two per tensor)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    for indices in by_device.values():
        rows = torch.stack([_digest(tensors[i]) for i in indices]).tolist()
        for i, (a, b) in zip(indices, rows):
            out[i] = (a, b)
    return out


class ReplicaGuard:
    """The consistency guard of one replica: what it contributes, and the check after the sum.

    Args:
        comm: the job's communicator (``rank``, ``world_size``, ``name``, ``all_gather``).
        fields: returns this replica's ``(step, global batch size, batch ordinal)`` now.
        params: returns the synchronised parameters as ``[(label, tensor), ...]``, in the same
            order on every replica.
        every: fingerprint the parameters again once this many steps have passed since the last
            fingerprint (0: only at the first step and after a restore).
        check_every: backward passes between two that carry the fields (:meth:`rides`; 0: every
            pass on a CPU, every :data:`~phalanx.config.GUARD_EVERY_GPU` on a GPU).

    Attributes:
        fingerprint_due: the next contribution with parameters carries a fingerprint.
        every: as the argument; every replica must hold the same value.
        checks: collectives checked, for tests and benchmarks.
    """

    def __init__(
        self,
        comm: object,
        fields: Callable[[], tuple[int, int, int]],
        params: Callable[[], list[tuple[str, torch.Tensor]]],
        every: int = 0,
        check_every: int = 0,
    ) -> None:
        self._comm = comm
        self._fields = FieldGuard(comm.rank, comm.world_size)  # type: ignore[attr-defined]
        self._values = fields
        self._params = params
        self._fingerprinted = False  # a fingerprint was taken: a parameter mismatch can be named
        self._step: int | None = None
        self._fingerprinted_at: int | None = None  # the step of the last fingerprint
        # A GPU pass's sum, copied to pinned memory without waiting, and its event: read at the
        # next pass (check_pending).
        self._pending: tuple[torch.Tensor, Any] | None = None
        self._readback: torch.Tensor | None = None
        self._read_event: Any = None
        self.fingerprint_due = True
        self.every = every
        self.check_every = check_every
        self._passes = 0  # backward passes that asked whether to ride (the same count on every replica)
        self.checks = 0

    def regrouped(self) -> None:
        """An elastic job's group re-formed: the fields take the new ranks, an unread check of the
        abandoned pass is dropped, and the next pass fingerprints the parameters (the survivors
        must still hold the same ones)."""
        self._fields = FieldGuard(self._comm.rank, self._comm.world_size)  # type: ignore[attr-defined]
        self._pending = None
        self.fingerprint_due = True
        self._passes = 0

    def rides(self, device: torch.device) -> bool:
        """Whether this backward pass carries the guard's fields (one call per pass).

        Every pass on a CPU, where writing and checking them costs a few microseconds. On a GPU
        every ``check_every``-th (:data:`~phalanx.config.GUARD_EVERY_GPU` by default, the first
        pass included): there a check costs a copy each way between host and device and their
        events, 100-300 us of host time a pass on an H200 (``benchmarks/gpu/guard_parts.py``), so
        a step or batch mismatch is raised up to that many passes late (one more: the sum is
        read at the next pass). A fingerprint after a restore rides at once; the periodic one
        (every ``every`` steps) at the first pass that rides from then on. Every replica counts
        the same passes and marks the same restores, so all decide alike.
        """
        self._passes += 1
        every = self.check_every or (GUARD_EVERY_GPU if device.type == "cuda" else 1)
        return every == 1 or self.fingerprint_due or self._passes % every == 1

    def ride(self, tail: torch.Tensor) -> bool:
        """Writes this pass's contribution into ``tail`` (the room after the first bucket's
        gradients) if it carries the guard (:meth:`rides`), else zeros it (its sum is not read);
        returns whether it did."""
        if self.rides(tail.device):
            self.write_into(tail)
            return True
        tail.zero_()
        return False

    def size(self, dtype: torch.dtype) -> int:
        """Elements the guard takes in a tensor of ``dtype`` (0: it cannot ride on that dtype)."""
        return self._fields.size(dtype)

    def fingerprint(self) -> int:
        """A 24-bit fingerprint (never 0) of the synchronised parameters (reads it back: a host sync on a GPU)."""
        return int(self._fingerprint_tensor())

    def _fingerprint_tensor(self) -> torch.Tensor:
        self._fingerprinted = True
        return fingerprint_tensor([t for _, t in self._params()])

    def _due(self, step: int, with_parameters: bool) -> bool:
        """Whether this contribution carries a fingerprint; if so, it is no longer due."""
        if not with_parameters or not (self.fingerprint_due or self._periodic_due(step)):
            return False
        # Every replica decides alike: the same step (else the step field differs), the same
        # `every`, the same backward passes since the last fingerprint.
        self.fingerprint_due = False
        self._fingerprinted_at = step
        return True

    def encode(
        self, dtype: torch.dtype, device: torch.device | str = "cpu", *, with_parameters: bool = True
    ) -> torch.Tensor | None:
        """This replica's contribution, to append to a tensor of ``dtype`` being all-reduced (SUM)."""
        if digits_for(dtype) is None:
            return None
        step, size, ordinal = self._values()
        fp = self.fingerprint() if self._due(step, with_parameters) else 0
        self._step = step
        return self._fields.encode((step, size, ordinal, fp), dtype, device)

    def write_into(self, out: torch.Tensor) -> None:
        """Writes this replica's contribution into ``out`` (``size(out.dtype)`` elements of a bucket).

        On a GPU without waiting for it: the fields come from pinned memory and the fingerprint,
        when due, is computed and placed on the device.
        """
        step, size, ordinal = self._values()
        due = self._due(step, True)
        self._step = step
        if due and out.device.type == "cpu":
            self._fields.write((step, size, ordinal, self.fingerprint()), out)
            return
        self._fields.write((step, size, ordinal, 0), out)
        if due:
            self._fields.place(FIELDS.index("parameters"), self._fingerprint_tensor().to(out.device), out)

    def _periodic_due(self, step: int) -> bool:
        last = self._fingerprinted_at
        return self.every > 0 and (last is None or step - last >= self.every)

    def verify(self, summed: torch.Tensor) -> None:
        """Checks the guard's part of the sum; raises ReplicaDivergenceError on every replica alike.

        Replicas at different steps are diagnosed first (the communicator's ``explain``): the
        replicas' flight recorders say which one skipped a step, and where it went on from.
        """
        self.checks += 1
        try:
            self._fields.check(summed, self._comm.name, self._step, self._first_difference)  # type: ignore[attr-defined]
        except ReplicaDivergenceError as e:
            explain = getattr(self._comm, "explain", None)
            if e.field != "step" or explain is None:
                raise
            explained = explain(e)
            if explained is e:
                raise
            raise explained from e

    def verify_later(self, summed: torch.Tensor) -> None:
        """Checks ``summed`` now on the CPU; on a GPU, copies it to pinned memory without waiting and
        checks it at :meth:`check_pending` (reading it at once would stall the host until the GPU
        finished the step, every step)."""
        if not summed.is_cuda:
            self.verify(summed)
            return
        self.check_pending()
        host = self._readback
        if host is None or host.numel() != summed.numel():
            host = self._readback = torch.empty(summed.numel(), dtype=torch.float32, pin_memory=True)
            self._read_event = torch.cuda.Event()
        host.copy_(summed, non_blocking=True)
        self._read_event.record()
        self._pending = (host, self._read_event)

    def check_pending(self) -> None:
        """Checks the sum :meth:`verify_later` left unread, if any.

        Raises:
            ReplicaDivergenceError: the replicas disagreed in that pass.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            host, done = pending
            done.synchronize()
            self.verify(host)

    def _first_difference(self, other: int) -> str | None:
        """The first parameter whose digest differs between replica 0 and ``other`` (a collective).

        The parameters are digested now: the replicas that disagreed at the fingerprint still do.
        """
        if not self._fingerprinted:
            return None
        named = self._params()
        mine = torch.tensor([x for pair in digests([t for _, t in named]) for x in pair], dtype=torch.int64)
        with recording(self._comm, "guard"):
            sizes = self._comm.all_gather(torch.tensor([mine.numel()]))  # type: ignore[attr-defined]
            if len({int(s) for s in sizes}) != 1:
                return f"(replica 0 has {int(sizes[0]) // 2} parameters, replica {other} {int(sizes[other]) // 2})"
            every = self._comm.all_gather(mine)  # type: ignore[attr-defined]
        a, b = every[0].tolist(), every[other].tolist()
        for i, (label, _) in enumerate(named):
            if a[2 * i : 2 * i + 2] != b[2 * i : 2 * i + 2]:
                return label
        return None
