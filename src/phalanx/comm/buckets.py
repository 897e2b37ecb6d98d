"""The gradient buckets of :class:`~phalanx.comm.reducer.GradientReducer`: their layout and flags.

A :class:`Bucket` is a group of parameters of one dtype and one device (:func:`plan` makes the
groups, as DDP's bucket assignment does: reverse creation order, ``bucket_bytes`` each) whose
gradients live in one flat buffer, summed across the replicas by one collective. After the
gradients the buffer holds one *used* flag per parameter (1: this replica's pass gave it a dense
gradient; summed, 0 means no replica used it) and one *sparse* flag (it got a sparse gradient,
summed apart), then, in the first bucket, the consistency guard's room. The reducer (the hooks,
launching and finishing each pass) lives in :mod:`phalanx.comm.reducer`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Bucket", "aliases", "plan", "write_flags"]


class Bucket:
    """Parameters of one dtype and device whose gradients live in one flat buffer and are summed
    by one collective: the gradients, one used-flag row, one sparse-flag row, then the guard's room."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        # Each parameter's place in the flat buffer, computed once: the hooks run every pass.
        self.sizes = [p.numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        self.numel = sum(self.sizes)
        self.ready: set[int] = set()
        self.handle: Any = None
        # The persistent buffer: the gradients, one "used" flag per parameter, then the guard's room.
        self.flat: torch.Tensor | None = None
        # Per parameter: its gradient's place in `flat`, shaped as the parameter; None for a
        # parameter that is not contiguous (channels_last): its .grad keeps autograd's layout.
        self.views: list[torch.Tensor | None] = []
        # One flag per parameter after the gradients, as a view of `flat`: 1 where this replica's
        # pass gave the parameter a (dense) gradient, 0 where not; summed, 0 means no replica used
        # it. A second row flags the parameters this replica gave a sparse gradient.
        self.flags: torch.Tensor | None = None
        self.sparse_flags: torch.Tensor | None = None
        # The guard's room after the flags (bucket 0), as a view of `flat`: made once, not per pass.
        self.tail: torch.Tensor | None = None
        # Whether this synchronisation zeroed the buffer for its first gradient (see start).
        self.started = False
        # Positions of the parameters this replica did not use in the pass being synchronised,
        # and, once summed, of those no replica used.
        self.unused_here: list[int] = []
        self.unused_everywhere: set[int] = set()
        self.sparse_here: list[int] = []  # given a sparse gradient here (nn.Embedding(sparse=True))

    @property
    def head(self) -> int:
        """Elements before the guard's room: the gradients and the two rows of flags."""
        return self.numel + 2 * len(self.params)

    def buffer(self, room: int = 0) -> torch.Tensor:
        """The bucket's flat buffer with ``room`` elements after the gradients and flags; made on first use.

        Made again, bigger, when the guard first needs room (bucket 0's first pass): gradients
        already moved in are carried over, and their parameters' ``.grad`` follow.
        """
        flat = self.flat
        if flat is not None and flat.numel() - self.head >= room:
            return flat
        first = self.params[0]
        grown = torch.empty(self.head + room, dtype=first.dtype, device=first.device)
        views: list[torch.Tensor | None] = []
        for i, p in enumerate(self.params):
            offset, n = self.offsets[i], self.sizes[i]
            view = grown[offset : offset + n].view(p.shape) if p.is_contiguous() else None
            if view is not None and flat is not None and p.grad is not None and aliases(p.grad, self.views[i]):
                view.copy_(p.grad)
                p.grad = view
            views.append(view)
        self.flat, self.views, self.tail = grown, views, None
        n = len(self.params)
        self.flags = grown[self.numel : self.numel + n]
        self.sparse_flags = grown[self.numel + n : self.head]
        return grown

    def start(self) -> None:
        """The first gradient of this bucket in a synchronisation: its buffer is zeroed for autograd
        to accumulate into. A parameter whose ``.grad`` lives there (an earlier sum, kept by a user
        who did not zero it) gets a copy of its own first: the zeroing must not touch it."""
        self.started = True
        fresh = self.flat is None
        flat = self.buffer()
        if not fresh:
            views = self.views
            for i, p in enumerate(self.params):
                g = p.grad
                if g is not None and aliases(g, views[i]):
                    p.grad = g.clone()
        flat[: self.numel].zero_()

    def read_unused(self, summed: torch.Tensor) -> tuple[set[int], set[int]]:
        """The positions of the parameters that no replica used (their summed flag is 0), and of
        those some replica gave a sparse gradient (summed apart), read from the bucket's sum.

        Read only where this replica did not use one densely itself (a parameter it used is used),
        so the usual pass reads nothing back: on a GPU, reading would wait for the all-reduce.
        """
        if not self.unused_here:
            return set(), set()
        n = len(self.params)
        flags = summed[self.numel : self.head].tolist()
        sparse = {pos for pos in self.unused_here if flags[n + pos] > 0}
        return {pos for pos in self.unused_here if flags[pos] == 0 and pos not in sparse}, sparse

    def holds_grad_of(self, pos: int) -> bool:
        """Whether the parameter at ``pos`` has its ``.grad`` in this bucket's buffer (its view)."""
        p = self.params[pos]
        return bool(self.views) and p.grad is not None and aliases(p.grad, self.views[pos])


def plan(params: list[torch.nn.Parameter], bucket_bytes: int, num_packs: int = 1) -> list[list[torch.nn.Parameter]]:
    """Groups ``params`` into buckets, in reverse creation order (roughly the order backward produces
    their gradients): at most ``bucket_bytes`` each (less, to make at least ``num_packs`` buckets),
    one dtype and one device each, so a bucket can be flattened into one tensor."""
    total = sum(p.numel() * p.element_size() for p in params)
    cap = max(1, min(bucket_bytes, -(-total // num_packs))) if num_packs > 1 else bucket_bytes
    groups: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in reversed(params):
        if current and (
            size + p.numel() * p.element_size() > cap or p.dtype != current[0].dtype or p.device != current[0].device
        ):
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        groups.append(current)
    return groups


def write_flags(flags: torch.Tensor, value: int, others: list[int]) -> None:
    """Sets every flag of a bucket's row to ``value``, but those at ``others`` to ``1 - value``."""
    flags.fill_(value)
    if not others:
        return
    if flags.is_cuda:  # one small kernel each, no index tensor copied from the host (which would wait)
        for pos in others:
            flags[pos : pos + 1].fill_(1 - value)
    else:
        flags[others] = 1 - value


def aliases(grad: torch.Tensor, view: torch.Tensor | None) -> bool:
    """Whether ``grad`` is ``view`` (the same memory, the same layout; a sparse one never is)."""
    return (
        view is not None
        and grad.layout == torch.strided
        and grad.data_ptr() == view.data_ptr()
        and grad.is_contiguous()
    )
