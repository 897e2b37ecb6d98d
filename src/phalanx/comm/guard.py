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

Example (two replicas, as the sum would combine their vectors)::

    >>> import torch
    >>> g0, g1 = FieldGuard(0, 2), FieldGuard(1, 2)
    >>> total = g0.encode((5, 32, 5, 0), torch.float32) + g1.encode((5, 32, 5, 0), torch.float32)
    >>> g0.check(total, lambda r: f"replica:{r}")  # agreement: returns quietly
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from phalanx.comm.flight_recorder import recording
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

    __slots__ = ("_buffers", "_width", "rank", "world_size")

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._width = len(FIELDS)
        # dtype -> a zero vector whose numpy view we write our slot into (it is copied by the
        # torch.cat that builds the bucket, so reusing it is safe): ~1 us instead of ~20 us for
        # building a tensor from a list on every step.
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, object]] = {}

    def size(self, dtype: torch.dtype) -> int:
        """Elements the guard appends to a tensor of ``dtype``."""
        return self.world_size * self._width * (digits_for(dtype) or 0)

    def encode(self, values: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A vector, zero but in this replica's slot, that sums to every replica's values."""
        digits = digits_for(dtype) or 1
        mine: list[int] = []
        for v in values:
            v = int(v) % _LIMIT
            if digits == 1:
                mine.append(v)
            else:
                mine += [(v >> 16) & 0xFF, (v >> 8) & 0xFF, v & 0xFF]
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
    ) -> None:
        self._comm = comm
        self._fields = FieldGuard(comm.rank, comm.world_size)  # type: ignore[attr-defined]
        self._values = fields
        self._params = params
        self._digests: list[tuple[int, int]] = []
        self._labels: list[str] = []
        self._step: int | None = None
        self._fingerprinted_at: int | None = None  # the step of the last fingerprint
        self.fingerprint_due = True
        self.every = every
        self.checks = 0

    def fingerprint(self) -> int:
        """A 24-bit fingerprint (never 0) of the synchronised parameters, remembering each's digest."""
        named = self._params()
        self._labels = [label for label, _ in named]
        self._digests = digests([t for _, t in named])
        h = 0xCBF29CE484222325
        for a, b in self._digests:  # FNV-1a over the digests
            for x in (a, b):
                h = ((h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        return 1 + h % (_LIMIT - 1)

    def encode(
        self, dtype: torch.dtype, device: torch.device | str = "cpu", *, with_parameters: bool = True
    ) -> torch.Tensor | None:
        """This replica's contribution, to append to a tensor of ``dtype`` being all-reduced (SUM)."""
        if digits_for(dtype) is None:
            return None
        step, size, ordinal = self._values()
        fp = 0
        if with_parameters and (self.fingerprint_due or self._periodic_due(step)):
            # Every replica decides alike: the same step (else the step field differs), the same
            # `every`, the same backward passes since the last fingerprint.
            self.fingerprint_due = False
            self._fingerprinted_at = step
            fp = self.fingerprint()
        self._step = step
        return self._fields.encode((step, size, ordinal, fp), dtype, device)

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

    def _first_difference(self, other: int) -> str | None:
        """The first parameter whose digest differs between replica 0 and ``other`` (a collective)."""
        if not self._digests:
            return None
        mine = torch.tensor([x for pair in self._digests for x in pair], dtype=torch.int64)
        with recording(self._comm, "guard"):
            sizes = self._comm.all_gather(torch.tensor([mine.numel()]))  # type: ignore[attr-defined]
            if len({int(s) for s in sizes}) != 1:
                return f"(replica 0 has {int(sizes[0]) // 2} parameters, replica {other} {int(sizes[other]) // 2})"
            every = self._comm.all_gather(mine)  # type: ignore[attr-defined]
        a, b = every[0].tolist(), every[other].tolist()
        for i, label in enumerate(self._labels):
            if a[2 * i : 2 * i + 2] != b[2 * i : 2 * i + 2]:
                return label
        return None
