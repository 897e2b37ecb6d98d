"""Gradient synchronisation during backward: buckets launched as they fill, as DDP does.

Parameters are grouped into buckets in reverse creation order (roughly the order backward
produces their gradients). Each parameter has one hook, run just before autograd accumulates its
gradient: it points ``.grad`` at the parameter's place in its bucket's flat buffer (zeroed when the
bucket's first gradient of a synchronisation arrives), so autograd adds the gradient there itself,
and counts the parameter ready. When every gradient of a bucket is ready, and every earlier bucket
has been launched, the bucket's all-reduce starts at the next hook (by then autograd has
accumulated the last gradient: a device's hooks and accumulations run one after the other on one
thread) while backward goes on. A callback queued on the autograd engine launches whatever is left
and waits for all buckets. Buckets are always launched in index order, so every replica issues the
same collectives in the same order whatever order its gradients arrive in. Per parameter that is
one Python call and no kernel: DDP's C++ reducer copies each gradient into its bucket (and, by
default, back). ``torch.autograd.grad`` runs the hooks too but accumulates nothing: a run is told
apart at its first hook (``_compat.torch.will_accumulate``) and left alone.

Gradients live in the buckets (DDP's ``gradient_as_bucket_view``): the all-reduce works on the
buffer itself and its sum *is* ``.grad``: no flattening copy, no copy back, and passes under
``no_sync`` accumulate in place. Parameters that are not contiguous (channels_last), and sparse
gradients, keep autograd's layout: the former are copied in and out; the latter are summed apart,
by gathering every replica's indices and values (TF's ``IndexedSlices``).

The sum, not the mean, is written back: :func:`phalanx.nn.compute_average_loss` has already
divided each replica's loss by the global batch size, so the sum equals the gradient of the
global batch on one device.

Unused parameters. A parameter this replica's pass did not reach adds zeros to the sum, and each
bucket carries one flag per parameter after its gradients (1: used here), summed with them. A
parameter that no replica used (flag sum 0) keeps the ``.grad`` it had, None after
``zero_grad()``, as on one device, under DDP with ``find_unused_parameters`` and in TF: an
optimizer then skips it, where a zero gradient would let momentum or weight decay move it. One
used by some replicas only gets the sum. The flags are read back only where this replica left a
parameter unused, so the usual pass never waits for them on a GPU. A parameter that begins to
train inside the pass (thawed in the step) joins in a bucket of its own at its end (``late``).

Accumulation. Only what *this* backward pass (and any passes under :meth:`GradientReducer.no_sync`
since the last synchronisation) added to ``.grad`` is summed across replicas; whatever ``.grad``
held before (the already summed gradient of an earlier micro-batch) is kept aside by the hook and
added back once. So K backward passes without ``zero_grad()`` give the same ``.grad`` as K passes on
one device over the same global batches.

Consistency. An optional guard (:class:`phalanx.comm.guard.ReplicaGuard`) writes every replica's
step, batch and, now and then, parameter fingerprint into room after the first bucket's flags and
checks them after the sum (on a GPU one pass later, without waiting), so replicas that drifted
apart raise :class:`~phalanx.errors.ReplicaDivergenceError`. It needs a collective that gives
every replica the sum: an all-reduce (MirroredStrategy, and CentralStorage on the same-host
shared-memory transport, whose other replicas drop the sum). Where only one replica gets it
(CentralStorage's gloo reduce to replica 0), ``guard_collective`` runs the guard in a small
all-reduce of its own just before the first bucket.

Here: the hooks, launching buckets and finishing each pass. The buckets' layout, buffers and flags
are :mod:`phalanx.comm.buckets`; sparse gradients are summed by :mod:`phalanx.comm.sparse_gradients`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from phalanx._compat.torch import (
    accumulation_node,
    current_graph_task_id,
    queue_backward_callback,
    tracing,
    will_accumulate,
)
from phalanx.comm.buckets import Bucket, aliases, plan, write_flags
from phalanx.comm.sparse_gradients import sum_sparse
from phalanx.errors import GroupChangedError

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb default


def _shape_of(param: torch.Tensor) -> str:
    return f"a parameter of shape {tuple(param.shape)}"


class GradientReducer:
    """Sums the gradients of ``params`` across all replicas during each backward pass.

    Args:
        params: the parameters to synchronise (those created in ``strategy.scope()``).
        all_reduce: ``(flat_tensor) -> handle`` starting a sum; ``handle.wait()`` ends it and returns
            the summed tensor (the same one, or a copy of it on another device).
        bucket_bytes: target bucket size; ``bytes_per_pack`` of ``CommunicationOptions``.
        num_packs: split the parameters into at least this many buckets.
        keep_grads: write the sums into ``.grad`` (True) or drop ``.grad`` after reducing (False).
        guard: checks that the replicas agree, riding on the first bucket of every pass.
        guard_collective: ``(guard) -> None``, exchanging and checking the guard in a collective of
            its own just before the first bucket of every pass; for a ``all_reduce`` that does not
            give every replica the sum (a reduce to one replica). None: the guard rides on the bucket.
        all_gather: ``(tensor) -> [every replica's tensor]``, for sparse gradients; None: a sparse
            gradient is a :class:`~phalanx.errors.SparseGradientError`.
        name_of: names a parameter in errors.
        persistent: keep each bucket's buffer from pass to pass, so ``.grad`` stays a view of it
            (DDP's ``gradient_as_bucket_view``; it holds one gradient-sized buffer even after
            ``zero_grad(set_to_none=True)``, as DDP's buckets do). False: a new buffer every pass,
            freed with the last ``.grad`` that views it (CentralStorage, whose point is memory).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        all_reduce: Callable[[torch.Tensor], Any],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        num_packs: int = 1,
        keep_grads: bool = True,
        guard: Any = None,
        guard_collective: Callable[[Any], None] | None = None,
        persistent: bool = True,
        all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None = None,
        name_of: Callable[[torch.Tensor], str] = _shape_of,
    ) -> None:
        self._all_reduce = all_reduce
        self._all_gather = all_gather
        self._name_of = name_of
        self._persistent = persistent
        self._guard_collective = guard_collective
        # False where the summed gradient is not needed (CentralStorage's non-chief replicas):
        # dropping .grad frees its memory and makes the optimizer skip the parameter.
        self._keep_grads = keep_grads
        self._buckets: list[Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        self._hooks: list[Any] = []
        self._pending = False
        self._next = 0
        self._lock = threading.Lock()  # autograd may run hooks of different devices on other threads
        self._task = -2  # the autograd run (graph task) the last hook ran in
        self._task_accumulates = True  # whether that run accumulates into .grad (backward, not autograd.grad)
        self._deferred = False  # a bucket is complete: launch it at the next hook (see _make_hook)
        self._early_launch = True  # launch buckets during backward (one device); else at its end
        self.sync = True  # False inside no_sync(): gradients accumulate locally
        self.guard = guard
        # Multiplies this replica's gradients before they are summed (Keras: its share of the batch).
        self.scale = 1.0
        # Returns parameters to join at the end of a pass (thawed inside it); None: none can.
        self.late: Callable[[], list[torch.nn.Parameter]] | None = None
        self.reductions = 0  # completed backward passes, for strategies that act after one
        # An elastic job's vote once every bucket has its sum, before any is used: returns when
        # every replica has them, raises GroupChangedError when the step is abandoned (comm/elastic.py).
        self.commit: Callable[[], None] | None = None
        self.skipped = 0  # backward passes under no_sync()
        # id(param) -> the .grad it held before this synchronisation's first backward (summed already)
        self._base: dict[int, torch.Tensor] = {}
        self._dirty: set[int] = set()  # params whose .grad holds unsynchronised local gradient
        self._guard_len = 0
        # The guard that wrote into the last pass's bucket: on a GPU it reads its part of the sum
        # one pass late (check_pending), even if the guard was turned off since.
        self._checked_by: Any = None
        self.add(params, bucket_bytes, num_packs)

    def add(
        self, params: list[torch.nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_packs: int = 1
    ) -> None:
        """Registers more parameters (created in a later ``scope()``) in new buckets."""
        params = [p for p in params if p.requires_grad and id(p) not in self._where]
        for group in plan(params, bucket_bytes, num_packs):
            self._new_bucket(group)

    def _new_bucket(self, params: list[torch.nn.Parameter]) -> None:
        index = len(self._buckets)
        bucket = Bucket(params)
        self._buckets.append(bucket)
        if len({p.device for bucket in self._buckets for p in bucket.params[:1]}) > 1:
            # Hooks of different devices run on different autograd threads: a bucket is launched
            # only at the end of backward, when every gradient is certainly accumulated.
            self._early_launch = False
        for pos, p in enumerate(params):
            self._where[id(p)] = (index, pos)
            self._hooks.append(p.register_hook(self._make_hook(p, bucket, index, pos)))

    def _make_hook(self, p: torch.nn.Parameter, bucket: Bucket, index: int, pos: int) -> Callable[[torch.Tensor], None]:
        """The one hook of ``p``: runs just before autograd accumulates its gradient into ``.grad``.

        It points ``.grad`` at the parameter's place in the bucket (zeroed when the bucket started
        this synchronisation), so autograd adds the gradient there itself: no copy of our own and
        no second hook. A bucket whose every parameter has been reached is launched at the next
        hook (its last gradient has been accumulated by then: a device's hooks and accumulations
        run one after the other on one thread) or at the end of backward. Runs once per parameter
        per pass: kept lean.
        """
        key, dirty, ready, lock = id(p), self._dirty, bucket.ready, self._lock
        node = accumulation_node(p)  # kept alive with the hook
        task_id = current_graph_task_id

        def hook(grad: torch.Tensor) -> None:
            if tracing():
                # Traced into a compiled backward: run as plain Python instead, never traced.
                return torch.compiler.disable(hook)(grad)
            with lock:
                task = task_id()
                if task != self._task:
                    self._new_task(task, node)
                if not self._task_accumulates:
                    return None  # autograd.grad(): nothing is accumulated into .grad
                if self._deferred:
                    self._launch_complete()
                if not self._pending:
                    self._pending = True
                    queue_backward_callback(self._finish if self.sync else self._finish_local)
                if key not in dirty:
                    dirty.add(key)
                    if not bucket.started:
                        bucket.start()
                    current = p.grad
                    if current is not None:
                        # Summed in an earlier pass: kept out of this pass's all-reduce, added back after.
                        self._base[key] = current
                    view = bucket.views[pos]
                    if view is not None and grad.layout == torch.strided and grad.dtype == view.dtype:
                        p.grad = view  # zero: autograd accumulates this pass's gradient in place
                    elif current is not None:
                        p.grad = None
                if self.sync:
                    ready.add(pos)
                    if self._early_launch and index == self._next and len(ready) == len(bucket.params):
                        self._deferred = True
            return None

        return hook

    def _new_task(self, task: int, node: Any) -> None:
        """The first hook of a new autograd run: does it accumulate into ``.grad``?

        ``torch.autograd.grad`` runs the parameters' hooks too, but accumulates nothing; torch
        refuses to say whether it will run a parameter's accumulation there (the one way to tell).
        """
        self._task = task
        self._task_accumulates = will_accumulate(node)

    def _launch_complete(self) -> None:
        """Launches, in order, every bucket whose parameters have all been reached and accumulated."""
        self._deferred = False
        buckets = self._buckets
        try:
            while self._next < len(buckets) and len(buckets[self._next].ready) == len(buckets[self._next].params):
                self._launch(buckets[self._next])
                self._next += 1
        except BaseException as e:
            # The pass is over (autograd re-raises this from backward): leave .grad as the user
            # left it and the reducer ready for the next pass.
            self._reset(abandoned=isinstance(e, GroupChangedError))
            raise

    def _in_bucket(self, p: torch.nn.Parameter) -> bool:
        b, pos = self._where[id(p)]
        return self._buckets[b].holds_grad_of(pos)

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient is synchronised here."""
        return id(param) in self._where

    def offset_of(self, param: torch.nn.Parameter) -> int:
        """Where ``param``'s gradient starts in its bucket's flat buffer (and in the bucket's sum)."""
        b, pos = self._where[id(param)]
        return self._buckets[b].offsets[pos]

    def parameters(self) -> list[torch.nn.Parameter]:
        """The synchronised parameters, in bucket order (the same on every replica)."""
        return [p for bucket in self._buckets for p in bucket.params]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first one after syncs them all."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    # ---------------------------------------------------------------------------- backward
    def _join_late(self, params: list[torch.nn.Parameter]) -> None:
        """Parameters that began to train during this pass (frozen, then thawed inside ``run``) join
        in new buckets, launched after the others: what this pass gave them is summed now, as if
        they had been registered before it. Every replica thaws the same ones at the same point,
        so the buckets stay alike (else their sizes differ: a typed error at the collective)."""
        if not params:
            return
        self.add(params)
        for p in params:
            if p.requires_grad and p.grad is not None:
                self._dirty.add(id(p))  # its gradient is this pass's: autograd made .grad, no hook of ours ran

    def _launch(self, bucket: Bucket) -> None:
        if bucket is self._buckets[0] and self.guard is not None and self._guard_collective is not None:
            self._guard_collective(self.guard)  # before any bucket: its collective comes first on every replica
        # The guard rides in room after bucket 0's gradients: one collective per bucket, not two.
        guard = self.guard if bucket is self._buckets[0] and self._guard_collective is None else None
        room = guard.size(bucket.params[0].dtype) if guard is not None else 0
        if bucket is self._buckets[0]:
            self._guard_len = room
        flat = bucket.buffer(room)
        dirty, views = self._dirty, bucket.views
        unused, sparse = bucket.unused_here, bucket.sparse_here = [], []
        for pos, p in enumerate(bucket.params):
            key, grad = id(p), p.grad
            if grad is not None and grad is views[pos] and key in dirty and p.requires_grad:
                continue  # the usual case: this pass's gradient is in its place already (the hook)
            offset = bucket.offsets[pos]
            place = flat[offset : offset + bucket.sizes[pos]]
            if grad is not None and grad.layout != torch.strided and key in dirty and p.requires_grad:
                # A sparse gradient (nn.Embedding(sparse=True)): summed apart, as TF's IndexedSlices
                # are (see sparse_gradients.sum_sparse); here it adds zeros, flagged sparse and not densely used.
                place.zero_()
                unused.append(pos)
                sparse.append(pos)
                continue
            if not p.requires_grad:
                # Frozen since registered: adds zeros, and its .grad is left as it is (see _finish),
                # so moved out of the bucket first if it was frozen after a pass put it there.
                if self._in_bucket(p):
                    p.grad = p.grad.clone()
                place.zero_()
                unused.append(pos)
                continue
            if key not in dirty:
                # Not reached by this replica's passes: it adds zeros and flags itself unused; an
                # earlier sum in .grad is kept aside (see _finish for what the flags decide).
                if p.grad is not None:
                    self._base[key] = p.grad.clone() if self._in_bucket(p) else p.grad
                    p.grad = None
                place.zero_()
                unused.append(pos)
            elif p.grad is None:
                place.zero_()
            elif not aliases(p.grad, bucket.views[pos]):
                place.view(p.shape).copy_(p.grad)  # not contiguous (channels_last), or replaced by the user
        if self.scale != 1.0:
            flat[: bucket.numel].mul_(self.scale)
        write_flags(bucket.flags, 1, unused)
        write_flags(bucket.sparse_flags, 0, sparse)
        if room:
            tail = bucket.tail
            if tail is None or tail.numel() != room:
                tail = bucket.tail = flat[bucket.head : bucket.head + room]
            if not guard.ride(tail):  # type: ignore[union-attr] # a pass it skips (GPUs): nothing to check
                self._guard_len = 0
            self._checked_by = guard
        end = bucket.head + room
        bucket.handle = self._all_reduce(flat if flat.numel() == end else flat[:end])

    def check_pending(self) -> None:
        """Checks the guard of the last pass if it is still unread (GPU replicas read it one pass late).

        A divergence in pass k on a GPU is raised during pass k + 1's backward, on every replica
        alike, or here: the strategy calls this before a checkpoint is written and when it closes.

        Raises:
            ReplicaDivergenceError: the replicas disagreed in that pass.
        """
        if self._checked_by is not None:
            self._checked_by.check_pending()

    def _finish_local(self) -> None:
        """End of a backward pass under no_sync(): nothing to send."""
        with self._lock:
            for bucket in self._buckets:
                bucket.ready.clear()
            self._pending = False
            self._deferred = False
            self.skipped += 1

    def _finish(self) -> None:
        if not self._pending:
            return  # the pass failed in a hook and was reset there
        abandoned = False
        try:
            with self._lock:
                if self.late is not None and self.sync:
                    self._join_late(self.late())
                while self._next < len(self._buckets):
                    self._launch(self._buckets[self._next])
                    self._next += 1
            self.check_pending()  # the previous pass's guard, on a GPU (long finished by now)
            if self.commit is not None:  # an elastic job: every replica uses the sums, or none does
                for bucket in self._buckets:
                    bucket.handle.wait()
                self.commit()
            base, keep, dirty = self._base, self._keep_grads, self._dirty
            sparse_sums: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []
            for index, bucket in enumerate(self._buckets):
                flat = bucket.handle.wait()
                own = bucket.flat
                # The sum is in the bucket's own buffer (not a copy on another device): each
                # parameter's view there already holds its summed gradient.
                in_own = own is not None and (
                    flat is own
                    or (flat.data_ptr() == own.data_ptr() and flat.dtype == own.dtype and flat.device == own.device)
                )
                if index == 0 and self._guard_len:
                    tail = bucket.tail
                    if not (in_own and tail is not None and tail.numel() == self._guard_len):
                        tail = flat[flat.numel() - self._guard_len :]
                    self._checked_by.verify_later(tail)  # type: ignore[union-attr]
                views = bucket.views
                gone, sparse = bucket.read_unused(flat)
                bucket.unused_everywhere = gone
                for pos, p in enumerate(bucket.params):
                    if not p.requires_grad:
                        # Frozen since it was registered (fine-tuning): left as on one device,
                        # where it gets no gradient, rather than given a zero one that an
                        # optimizer's momentum or weight decay would still apply.
                        continue
                    key = id(p)
                    # What .grad held before this synchronisation, set aside by the hook or at launch.
                    prior = base.pop(key, None) if base else None
                    if pos in sparse:
                        sparse_sums.append((p, prior))
                        continue
                    if not keep:
                        p.grad = None
                        continue
                    if pos in gone:
                        # No replica used it: .grad stays what it was (None after zero_grad()), as on
                        # one device, so the optimizer skips it (DDP's find_unused_parameters does the same).
                        p.grad = prior
                        continue
                    grad = p.grad
                    if prior is None and in_own and grad is not None and grad is views[pos]:
                        continue  # the usual case: .grad is the bucket's view, which now holds the sum
                    offset = bucket.offsets[pos]
                    chunk = flat[offset : offset + bucket.sizes[pos]].view(p.shape)
                    if p.is_contiguous():
                        # The summed gradient is the bucket's view (DDP's gradient_as_bucket_view): no
                        # copy back, and the next pass finds .grad in place. a + b == b + a in IEEE
                        # arithmetic, so adding the earlier sum here gives the bits prior + chunk gave.
                        p.grad = chunk if prior is None else chunk.add_(prior)
                    elif prior is not None:
                        p.grad = prior.add_(chunk)
                    elif p.grad is None or key not in dirty:
                        p.grad = chunk.clone()
                    else:
                        p.grad.copy_(chunk)  # keeps the layout autograd gave it (channels_last, ...)
            if sparse_sums:
                sum_sparse(sparse_sums, self._all_gather, self._name_of)
            self.reductions += 1
        except GroupChangedError:
            abandoned = True
            raise
        finally:
            self._reset(abandoned)

    def _reset(self, abandoned: bool = False) -> None:
        """Ends a pass, finished or failed: clears its state and puts set-aside gradients back; an
        ``abandoned`` one (an elastic job's group changed) leaves ``.grad`` as before it, no partial sum."""
        if abandoned:
            for p in [p for bucket in self._buckets for p in bucket.params]:
                if id(p) in self._dirty or id(p) in self._base:
                    p.grad = self._base.pop(id(p), None)
        for bucket in self._buckets:
            bucket.ready.clear()
            bucket.handle = None
            bucket.started = False
            if not self._persistent:  # .grad keeps this pass's buffer alive as long as the user keeps .grad
                bucket.flat, bucket.views, bucket.tail = None, [], None
                bucket.flags = bucket.sparse_flags = None
        self._next = 0
        self._pending = False
        self._deferred = False
        self._guard_len = 0
        # After a failure the set-aside gradients go back, so .grad is what the user left.
        for key, base in self._base.items():
            p = self._param_of(key)
            if p is not None:
                p.grad = base if p.grad is None else base.add_(p.grad)
        self._base.clear()
        self._dirty.clear()

    def _param_of(self, key: int) -> torch.nn.Parameter | None:
        where = self._where.get(key)
        return self._buckets[where[0]].params[where[1]] if where is not None else None

    def remove(self) -> None:
        """Detaches the hooks (the strategy is being closed)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
