"""Gradient synchronisation during backward: buckets launched as they fill, as DDP does.

Parameters are grouped into buckets in reverse creation order (roughly the order backward
produces their gradients). When every gradient of a bucket is ready, and every earlier bucket has
been launched, the bucket is flattened and its all-reduce starts while backward goes on. A
callback queued on the autograd engine launches whatever is left (gradients of parameters this
replica did not use count as zeros), waits for all buckets and writes the sums back into
``.grad``. Buckets are always launched in index order, so every replica issues the same
collectives in the same order whatever order its gradients arrive in.

The sum, not the mean, is written back: :func:`phalanx.nn.compute_average_loss` has already
divided each replica's loss by the global batch size, so the sum equals the gradient of the
global batch on one device.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from phalanx._compat.torch import queue_backward_callback
from phalanx.comm.cross_device_ops import CrossDeviceOps

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb default


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.ready: set[int] = set()
        self.handle: Any = None
        self.flat: torch.Tensor | None = None


class GradientReducer:
    """Sums the gradients of ``params`` across all replicas during each backward pass.

    Args:
        params: the parameters to synchronise (those created in ``strategy.scope()``).
        all_reduce: ``(flat_tensor) -> handle`` starting an in-place sum; ``handle.wait()`` ends it.
        bucket_bytes: target bucket size; ``bytes_per_pack`` of ``CommunicationOptions``.
        num_packs: split the parameters into at least this many buckets.
        keep_grads: write the sums into ``.grad`` (True) or drop ``.grad`` after reducing (False).
    """

    def __init__(self, params: list[torch.nn.Parameter], all_reduce: Callable[[torch.Tensor], Any],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_packs: int = 1, keep_grads: bool = True) -> None:
        self._all_reduce = all_reduce
        # False where the summed gradient is not needed (CentralStorage's non-chief replicas):
        # dropping .grad frees its memory and makes the optimizer skip the parameter.
        self._keep_grads = keep_grads
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        self._hooks: list[Any] = []
        self._pending = False
        self._next = 0
        self._lock = threading.Lock()  # autograd may run hooks of different devices on other threads
        self.enabled = True
        self.reductions = 0  # completed backward passes, for strategies that act after one
        self.add(params, bucket_bytes, num_packs)

    def add(self, params: list[torch.nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            num_packs: int = 1) -> None:
        """Registers more parameters (created in a later ``scope()``) in new buckets."""
        params = [p for p in params if p.requires_grad and id(p) not in self._where]
        if not params:
            return
        total = sum(p.numel() * p.element_size() for p in params)
        cap = max(1, min(bucket_bytes, -(-total // num_packs))) if num_packs > 1 else bucket_bytes
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            # A bucket holds one dtype and one device, so it can be flattened into one tensor.
            if current and (size + p.numel() * p.element_size() > cap or p.dtype != current[0].dtype
                            or p.device != current[0].device):
                self._new_bucket(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self._new_bucket(current)

    def _new_bucket(self, params: list[torch.nn.Parameter]) -> None:
        index = len(self._buckets)
        self._buckets.append(_Bucket(params))
        for pos, p in enumerate(params):
            self._where[id(p)] = (index, pos)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ---------------------------------------------------------------------------- backward
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self.enabled:
            return
        with self._lock:
            if not self._pending:
                self._pending = True
                queue_backward_callback(self._finish)
            b, pos = self._where[id(param)]
            self._buckets[b].ready.add(pos)
            while self._next < len(self._buckets) and len(self._buckets[self._next].ready) == len(
                    self._buckets[self._next].params):
                self._launch(self._buckets[self._next])
                self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
        bucket.handle = self._all_reduce(bucket.flat)

    def _finish(self) -> None:
        try:
            with self._lock:
                while self._next < len(self._buckets):
                    self._launch(self._buckets[self._next])
                    self._next += 1
            for bucket in self._buckets:
                flat = bucket.handle.wait()
                offset = 0
                for p in bucket.params:
                    n = p.numel()
                    chunk = flat[offset:offset + n].view_as(p)
                    if not self._keep_grads:
                        p.grad = None
                    elif p.grad is None:
                        p.grad = chunk.clone()
                    else:
                        p.grad.copy_(chunk)
                    offset += n
            self.reductions += 1
        finally:
            for bucket in self._buckets:
                bucket.ready.clear()
                bucket.handle = bucket.flat = None
            self._next = 0
            self._pending = False

    def remove(self) -> None:
        """Detaches the hooks (the strategy is being closed)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
