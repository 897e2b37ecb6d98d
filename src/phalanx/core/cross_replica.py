"""Collectives on the values of ``run`` across the replicas' processes (``extended.cross_replica``).

TF reduces a per-replica value with its cross-device ops, all inside one process, and checks
that the replicas' results have one structure when it regroups them. Here every replica is a
process, so both are collectives: one all-reduce per dtype carries the values, the consistency
guard's numbers, and a digest of the last ``run`` result's structure in this replica's slot, so
that the check costs no message of its own.

Example:
    >>> import torch, phalanx as px
    >>> strategy = px.OneDeviceStrategy("cpu")
    >>> strategy.extended.cross_replica.all_reduce([torch.ones(2)], px.ReduceOp.SUM)
    [tensor([1., 1.])]
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from phalanx.comm.communicator import Communicator
from phalanx.comm.guard import digits_for
from phalanx.core import regroup
from phalanx.core.consistency import ConsistencyChecks
from phalanx.errors import (
    CollectiveMismatchError,
    GatherShapeError,
    NonDistributedValueError,
    RunStructureMismatchError,
)
from phalanx.values import DistributedValues, PerReplica, ReduceOp, local_results, mean_dtype

_NO_RESULT = object()
_MAX_RANK = 16  # dimensions a gathered tensor may have (the shapes travel in a fixed-size message)


class CrossReplicaValues:
    """Reduces, gathers and compares values across every replica of the job.

    Every method is a collective where the job has several processes: each replica calls it at
    the same point, with values of the same structure (a difference is a typed error on every
    replica, never a hang).

    Args:
        comm: the communicator among all replicas.
        device: this replica's device (where a structure check's own message is made).
        consistency: the guard's switch (its numbers ride on SUM reductions).
        num_workers: the hosts whose replicas share an input pipeline (TF's workers).
        worker_index: this process's worker.
        step: the step the job is at, for error messages.
        collectives: whether values travel at all (several replicas, or a group built anyway).
    """

    def __init__(
        self,
        comm: Communicator,
        device: torch.device,
        consistency: ConsistencyChecks,
        num_workers: int,
        worker_index: int,
        step: Callable[[], int],
        collectives: bool,
    ) -> None:
        self._comm = comm
        self._device = device
        self._consistency = consistency
        self._num_workers = max(num_workers, 1)
        self._worker_index = worker_index
        self._step = step
        self._collectives = collectives
        # The last `run` result no collective has compared across replicas yet (TF's regroup check).
        self._unchecked: Any = _NO_RESULT
        self._slot_buffers: dict[torch.dtype, tuple[torch.Tensor, Any]] = {}

    # ---------------------------------------------------------------- TF's regroup check
    def remember_result(self, result: Any) -> None:
        """Keeps ``result`` (of this replica's ``run``) to compare at the next collective that reads it."""
        if self._comm.world_size > 1:
            self._unchecked = result

    def take_structure(self) -> str | None:
        """The description of the last ``run`` result, if no collective has compared it yet."""
        result = self._unchecked
        if result is _NO_RESULT:
            return None
        self._unchecked = _NO_RESULT
        return regroup.describe(result)

    def check_structures(self, description: str | None, exchange: bool = False) -> None:
        """Compares ``description`` across the replicas; raises on every replica if they differ.

        Args:
            description: this replica's (None: nothing to compare).
            exchange: they are known to differ, or may: send the descriptions themselves.

        Raises:
            RunStructureMismatchError: the replicas' descriptions differ.
        """
        if description is None or self._comm.world_size == 1:
            return
        if not exchange:
            slots = self._structure_slots(description, torch.int64, self._device).clone()
            try:
                self._comm.all_reduce(slots, "sum").wait()
            except CollectiveMismatchError:  # a peer sent a reduction of a result shaped otherwise
                slots = None
            if slots is not None and bool((slots == slots[0]).all()):
                return
        raw = torch.tensor(list(description.encode()), dtype=torch.uint8)
        texts = [bytes(p.tolist()).decode(errors="replace") for p in self.all_gather_list(raw)]
        if len(set(texts)) > 1:
            raise RunStructureMismatchError(texts, step=self._step())

    def _structure_slots(self, description: str, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """A vector, zero but in this replica's slot, which holds the digest of ``description``."""
        if torch.device(device).type != "cpu":
            slots = torch.zeros(self._comm.world_size, dtype=dtype, device=device)
            slots[self._comm.rank] = regroup.digest(description)
            return slots
        # On the CPU a reused vector written through numpy: ~1 us instead of ~10 us of tensor calls
        # on every reduce after a run. Safe to reuse: the caller copies it (torch.cat, clone).
        cached = self._slot_buffers.get(dtype)
        if cached is None:
            buffer = torch.zeros(self._comm.world_size, dtype=dtype)
            cached = self._slot_buffers[dtype] = (buffer, buffer.numpy())
        cached[1][self._comm.rank] = regroup.digest(description)
        return cached[0]

    def _verify_structures(self, slots: torch.Tensor, description: str) -> None:
        seen = slots.numpy() if slots.device.type == "cpu" else slots.cpu().numpy()
        if not (seen == seen[0]).all():
            self.check_structures(description, exchange=True)

    # ---------------------------------------------------------------- reductions
    def all_reduce(self, tensors: list[torch.Tensor], op: ReduceOp, structure: str | None = None) -> list[torch.Tensor]:
        """One all-reduce per dtype; new tensors, the same on every replica.

        Integer means are computed in floating point, with TF's true-division dtypes.

        Args:
            tensors: this replica's tensors.
            op: SUM or MEAN.
            structure: the last ``run`` result's description (:meth:`take_structure`), compared
                across replicas by a digest in each replica's slot of the first message that can
                carry it.
        """
        if not self._collectives:
            return list(tensors)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            dtype = t.dtype if (op is ReduceOp.SUM or t.is_floating_point()) else mean_dtype(t.dtype)
            groups.setdefault(dtype, []).append(i)
        if structure is not None and not any(d in regroup.SLOT_DTYPES for d in groups):
            self.check_structures(structure)  # no message can carry the digest: one of its own
            structure = None
        guard = self._consistency.active if op is ReduceOp.SUM else None
        try:
            for dtype, idx in groups.items():
                pieces = [tensors[i].detach().to(dtype).reshape(-1) for i in idx]
                extra = slots = None
                if guard is not None and digits_for(dtype) is not None:
                    extra = guard.encode(dtype, pieces[0].device, with_parameters=False)
                    pieces.append(extra)
                if structure is not None and dtype in regroup.SLOT_DTYPES:
                    slots = self._structure_slots(structure, dtype, pieces[0].device)
                    pieces.append(slots)
                flat = torch.cat(pieces)
                # A mean that carries slots is summed here and divided below: the slots must stay exact.
                mean = op is ReduceOp.MEAN and slots is None
                flat = self._comm.all_reduce(flat, "mean" if mean else "sum").wait()
                end = flat.numel()
                if slots is not None:
                    self._verify_structures(flat[end - slots.numel() :], structure)
                    end -= slots.numel()
                    structure = None
                    if op is ReduceOp.MEAN:
                        flat[:end].div_(self._comm.world_size)
                if extra is not None:
                    guard.verify(flat[end - extra.numel() : end])
                    guard = None  # one message per collective carries it
                offset = 0
                for i in idx:
                    n = tensors[i].numel()
                    out[i] = flat[offset : offset + n].view(tensors[i].shape)
                    offset += n
        except CollectiveMismatchError:
            if structure is not None:  # replicas with different results sent different messages
                self.check_structures(structure, exchange=True)
            raise
        return out  # type: ignore[return-value]

    def reduce(self, op: ReduceOp, leaves: list[Any], structure: str | None = None) -> list[torch.Tensor]:
        """TF's one rule for ``Strategy.reduce``, ``reduce_to`` and ``batch_reduce_to``.

        Distributed values are reduced across every replica. A value that is not distributed (a
        plain tensor) is one value per *worker*, as in TF where all of a worker's replicas share
        one process: on one worker, MEAN returns it and SUM over several replicas is refused
        (:class:`NonDistributedValueError`, TF's ValueError), except an all-zero non-tensor, which
        reduces to zeros; over several workers it is reduced across the workers (TF's
        testReduceHostTensor: SUM of 1.0 on 2 workers is 2.0).
        """
        world, workers = self._comm.world_size, self._workers
        tensors = [torch.as_tensor(local_results(v)[0]) for v in leaves]
        host = [not isinstance(v, DistributedValues) for v in leaves]
        if world == 1:
            return tensors
        if workers == 1:
            for i, leaf in enumerate(leaves):
                if host[i] and op is ReduceOp.SUM:
                    if not isinstance(leaf, torch.Tensor) and not bool(torch.any(tensors[i] != 0)):
                        continue  # TF: a plain 0 (or array of zeros) reduces to zeros
                    raise NonDistributedValueError(leaf, op, world)
            shared = [i for i, h in enumerate(host) if not h]
            reduced = self.all_reduce([tensors[i] for i in shared], op, structure) if shared else []
            if not shared:
                self.check_structures(structure)
            for i, t in zip(shared, reduced):
                tensors[i] = t
            return tensors
        # Several workers: each worker's value counts once (its first replica's process sends it).
        first_of_worker = self._comm.rank % (world // workers) == 0
        sent = [t if (not h or first_of_worker) else torch.zeros_like(t) for t, h in zip(tensors, host)]
        sums = self.all_reduce(sent, ReduceOp.SUM, structure)
        if op is ReduceOp.SUM:
            return sums
        return [
            (s if s.is_floating_point() else s.to(mean_dtype(s.dtype))) / (workers if h else world)
            for s, h in zip(sums, host)
        ]

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Overwrites ``tensors`` in place with process ``src``'s values, one message per dtype and device."""
        if self._comm.world_size == 1 or not tensors:
            return
        for group in by_dtype(tensors).values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self._comm.broadcast(flat, src=src)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    @property
    def _workers(self) -> int:
        # An elastic job that lost a worker of one process has one worker fewer.
        return min(self._num_workers, self._comm.world_size)

    # ---------------------------------------------------------------- gathers
    def local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this worker's replicas (gathered from their processes)."""
        per_worker = self._comm.world_size // self._workers
        if per_worker <= 1 or not isinstance(value, DistributedValues):
            return local_results(value)
        if not isinstance(value, PerReplica):
            return local_results(value) * per_worker  # the same on every replica
        mine = value.values[0]
        if isinstance(mine, str):  # a replica's text (a merge_call result, a ValueContext's str)
            raw = torch.tensor(list(mine.encode()), dtype=torch.uint8)
            everyone: list[Any] = [bytes(p.tolist()).decode() for p in self.all_gather_list(raw)]
        elif isinstance(mine, (bool, int, float)):
            kind = type(mine)
            everyone = [kind(p.item()) for p in self.all_gather_list(torch.as_tensor(mine))]
        elif isinstance(mine, torch.Tensor) or hasattr(mine, "__array__"):
            everyone = self.all_gather_list(torch.as_tensor(mine))
        else:
            raise TypeError(
                f"experimental_local_results gathers this worker's replicas' values from their processes; it "
                f"gathers tensors, numbers and strings, not {type(mine).__name__} ({mine!r:.80}). HINT: return "
                "tensors from the function given to strategy.run"
            )
        first = self._worker_index * per_worker
        return tuple(everyone[first : first + per_worker])

    def _exchange_shapes(self, tensor: torch.Tensor) -> list[tuple[int, ...]]:
        """Every replica's shape of ``tensor`` (one small collective); refuses different dtypes."""
        if tensor.dim() > _MAX_RANK:
            raise ValueError(
                f"gathering a tensor of rank {tensor.dim()} is not supported (at most {_MAX_RANK}); reshape it first"
            )
        msg = torch.zeros(2 + _MAX_RANK, dtype=torch.int64)
        msg[0], msg[1] = tensor.dim(), regroup.digest(str(tensor.dtype))
        msg[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        parts = self._comm.all_gather(msg)
        shapes = [tuple(int(d) for d in p[2 : 2 + int(p[0])]) for p in parts]
        if len({int(p[1]) for p in parts}) > 1:
            raise GatherShapeError(shapes, None, reason="the replicas' tensors have different dtypes")
        return shapes

    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every replica's ``tensor``, whatever its shape, in replica order (two collectives)."""
        shapes = self._exchange_shapes(tensor)
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        flat = tensor.detach().reshape(-1)
        if flat.numel() < max(sizes):
            flat = torch.cat([flat, flat.new_zeros(max(sizes) - flat.numel())])
        parts = self._comm.all_gather(flat.contiguous())
        return [p[:n].reshape(s) for p, n, s in zip(parts, sizes, shapes)]

    def all_gather(self, tensor: Any, axis: int) -> torch.Tensor:
        """Every replica's ``tensor`` concatenated along ``axis`` in replica order (lengths may differ).

        Raises:
            GatherShapeError: the replicas' tensors differ off ``axis``, in rank or dtype, or
                ``axis`` is out of range (on every replica alike).
        """
        tensor = torch.as_tensor(local_results(tensor)[0])
        if self._comm.world_size == 1:
            return tensor
        # Replicas may hold different lengths along `axis` (an uneven last batch); any other
        # difference is refused on every replica at once (the shapes are exchanged first).
        shapes = self._exchange_shapes(tensor)
        if len({len(s) for s in shapes}) > 1:
            raise GatherShapeError(shapes, axis, reason="the replicas' tensors have different ranks")
        if tensor.dim() == 0:
            raise GatherShapeError(shapes, axis, reason="scalars cannot be concatenated (rank >= 1 is needed)")
        if not -tensor.dim() <= axis < tensor.dim():
            raise GatherShapeError(shapes, axis, reason=f"the axis is out of range for rank {tensor.dim()}")
        axis = axis % tensor.dim()
        if len({s[:axis] + s[axis + 1 :] for s in shapes}) > 1:
            raise GatherShapeError(shapes, axis, reason="their sizes differ off the gather axis")
        sizes = [s[axis] for s in shapes]
        longest = max(sizes)
        if tensor.shape[axis] < longest:
            pad_shape = list(tensor.shape)
            pad_shape[axis] = longest - tensor.shape[axis]
            tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=axis)
        parts = self._comm.all_gather(tensor.contiguous())
        return torch.cat([p.narrow(axis, 0, n) for p, n in zip(parts, sizes)], dim=axis)


def by_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    """Groups ``tensors`` by (dtype, device), keeping their order within each group."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups
