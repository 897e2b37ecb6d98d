"""How the gradients of all replicas are summed: ``tf.distribute``'s CrossDeviceOps.

Each class is a distinct reduction algorithm over the job's communicator:

* :class:`NcclAllReduce`: the backend's native all-reduce (NCCL on GPUs, gloo's ring on CPUs),
  asynchronous, so buckets of gradients overlap with the rest of backward.
* :class:`ReductionToOneDevice`: every replica sends to one replica, which sums and broadcasts
  the result back (TF's reduce-to-CPU-then-copy).
* :class:`HierarchicalCopyAllReduce`: replicas are split into groups (by host, or in two halves
  on one host); each group reduces to its leader, leaders all-reduce among themselves, and each
  leader broadcasts to its group.

Example::

    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"],
                                        cross_device_ops=phalanx.ReductionToOneDevice())
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.communicator import Communicator, Handle


class CrossDeviceOps:
    """Base class: ``all_reduce(comm, tensor, op)`` starts an in-place reduction of ``tensor``.

    Args:
        num_packs: how many packs a batch of gradients is split into (TF's ``num_packs``); more
            packs start communicating earlier, fewer packs mean fewer messages.
    """

    def __init__(self, num_packs: int = 1) -> None:
        if not isinstance(num_packs, int) or num_packs < 1:
            raise ValueError(f"num_packs must be a positive int; received {num_packs!r}")
        self.num_packs = num_packs

    def all_reduce(self, comm: Communicator, tensor: torch.Tensor, op: str = "sum") -> Handle:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self.num_packs})"


class NcclAllReduce(CrossDeviceOps):
    """The backend's native all-reduce (the default)."""

    def all_reduce(self, comm: Communicator, tensor: torch.Tensor, op: str = "sum") -> Handle:
        return comm.all_reduce(tensor, op)


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce to one replica, then broadcast from it.

    Args:
        reduce_to_device: the replica index that sums (TF takes a device name; a name such as
            ``"cpu:1"`` or ``"/gpu:1"`` selects replica 1). Default: replica 0.
        accumulation_fn: unused; kept for TF signature compatibility.
    """

    def __init__(self, reduce_to_device: Any = None, accumulation_fn: Any = None) -> None:
        super().__init__(num_packs=1)
        if reduce_to_device is None:
            self.root = 0
        elif isinstance(reduce_to_device, int):
            self.root = reduce_to_device
        else:
            from phalanx.devices import canonicalize

            self.root = canonicalize(reduce_to_device).index

    def all_reduce(self, comm: Communicator, tensor: torch.Tensor, op: str = "sum") -> Handle:
        root = self.root if self.root < comm.world_size else 0
        if comm.world_size > 1:
            comm.reduce(tensor, dst=root)
            comm.broadcast(tensor, src=root)
        if op == "mean":
            tensor.div_(comm.world_size)
        return Handle(tensor)


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Two-level reduction: within groups to a leader, across leaders, back down to the groups."""

    def __init__(self, num_packs: int = 1) -> None:
        super().__init__(num_packs)
        self._groups: dict[tuple[int, bool], tuple[list[int], Any, Any]] = {}  # (communicator, CUDA) -> groups

    @staticmethod
    def _layout(comm: Communicator) -> list[list[int]]:
        hosts: dict[str, list[int]] = {}
        for r in range(comm.world_size):
            hosts.setdefault(comm.host_of(r), []).append(r)
        groups = list(hosts.values())
        if len(groups) == 1 and comm.world_size >= 4:  # one host: two halves, as TF does on a DGX-1
            half = (comm.world_size + 1) // 2
            groups = [groups[0][:half], groups[0][half:]]
        return groups

    def _setup(self, comm: Communicator, cuda: bool) -> tuple[list[int], Any, Any]:
        key = (id(comm), cuda)
        if key not in self._groups:
            groups = self._layout(comm)
            leaders = [g[0] for g in groups]
            mine = next(g for g in groups if comm.rank in g)
            # Every rank builds the groups it belongs to; gloo groups need only their members. CUDA
            # tensors of an NCCL job get NCCL groups (the communicator decides).
            kind = "-cuda" if cuda else ""
            local = (
                comm.subgroup(mine, tag=f"hier-local-{leaders.index(mine[0])}{kind}", cuda=cuda)
                if len(mine) > 1
                else None
            )
            top = (
                comm.subgroup(leaders, tag=f"hier-leaders{kind}", cuda=cuda)
                if comm.rank in leaders and len(leaders) > 1
                else None
            )
            self._groups[key] = (mine, local, top)
        return self._groups[key]

    def all_reduce(self, comm: Communicator, tensor: torch.Tensor, op: str = "sum") -> Handle:
        if comm.world_size > 1 and tensor.is_cuda and getattr(comm, "backend", "nccl") != "nccl":
            # gloo reduces CUDA tensors only in all-reduce and broadcast: the whole tree runs on a host copy.
            host = tensor.cpu()
            self.all_reduce(comm, host, op).wait()
            return Handle(tensor.copy_(host))
        if comm.world_size > 1:
            members, local, top = self._setup(comm, tensor.is_cuda)
            if local is not None:
                opts = dist.ReduceOptions()
                opts.rootRank, opts.reduceOp = 0, dist.ReduceOp.SUM
                with comm.errors_for("hierarchical reduce"):
                    local.reduce([tensor], opts).wait()
            if top is not None:
                with comm.errors_for("hierarchical all-reduce"):
                    top.allreduce([tensor]).wait()
            if local is not None:
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                with comm.errors_for("hierarchical broadcast"):
                    local.broadcast([tensor], opts).wait()
        if op == "mean":
            tensor.div_(comm.world_size)
        return Handle(tensor)
