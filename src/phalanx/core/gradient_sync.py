"""How a strategy's gradients become one gradient: the object its extended holds (``extended.gradient_sync``).

A strategy does not override hooks of its extended to synchronise gradients; it chooses one of
these objects, as Lightning's strategies hold a backward-sync control and FSDP2 a state per module:

* :class:`GradientSync` (this base): nothing to synchronise (one replica without collectives;
  parameter-server workers push their gradients themselves).
* :class:`AllReduce`: every replica's gradients summed into every replica's ``.grad`` during
  backward, bucket by bucket (:class:`phalanx.comm.reducer.GradientReducer`): MirroredStrategy and
  MultiWorkerMirroredStrategy.
* ``Central`` (``strategies/central_storage.py``): one copy of the variables, the sum to the chief.
* ``Sharded`` (``strategies/fully_sharded.py``): FSDP2's reduce-scatter into each replica's shard.

The extended calls it at fixed points: :meth:`attach` once new variables are identical on every
replica, :meth:`adopt_thawed` for parameters created frozen that now train, :meth:`before_run` /
:meth:`enter_step` / :meth:`after_run` around each step, and :meth:`close`. Integrations ask it
for :meth:`no_sync` (accumulation) and :meth:`scaled` (Keras scales each replica's gradient by
its share of the batch).

Example:
    >>> import torch, phalanx as px
    >>> strategy = px.OneDeviceStrategy("cpu")
    >>> type(strategy.extended.gradient_sync).__name__   # one replica: nothing to synchronise
    'GradientSync'
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from phalanx.comm.communicator import Communicator
from phalanx.comm.cross_device_ops import CrossDeviceOps
from phalanx.comm.reducer import DEFAULT_BUCKET_BYTES, GradientReducer


class GradientSync:
    """Synchronises nothing: the base, and the choice of one replica without collectives."""

    def attach(self, params: list[torch.nn.Parameter]) -> None:
        """``params`` (just made identical on every replica) join the synchronisation."""

    def adopt_thawed(self, params: list[torch.nn.Parameter]) -> None:
        """Parameters created frozen that require gradients now join it (every replica alike)."""
        self.attach(params)

    def before_run(self) -> None:
        """At the start of a step, before the variables created since the last one are synchronised."""

    def enter_step(self) -> None:
        """Right before the step's function runs (the step's variables are synchronised)."""

    def after_run(self) -> None:
        """When the step's function has returned."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate locally; the first one after sums everything."""
        return contextlib.nullcontext()

    def scaled(self, factor: float) -> contextlib.AbstractContextManager[None]:
        """Gradients of the backward passes inside are multiplied by ``factor`` before they are summed."""
        return contextlib.nullcontext()

    def scales(self, param: torch.Tensor) -> bool:
        """Whether :meth:`scaled` reaches ``param``'s gradient (else its owner scales it itself)."""
        return False

    def parameters(self) -> list[torch.Tensor]:
        """The synchronised parameters, in the same order on every replica (the guard fingerprints them)."""
        return []

    @property
    def passes(self) -> int:
        """Backward passes that synchronised or accumulated so far (a step that ran backward changes it)."""
        return 0

    def set_guard(self, guard: Any) -> None:
        """The consistency guard to carry from now on (None: none)."""

    def check_pending(self) -> None:
        """Checks a guard result left unread (GPU replicas read it one pass late)."""

    def regrouped(self) -> None:
        """An elastic job's group re-formed during the step, which runs again (the abandoned pass
        already gave ``.grad`` back as it was before it)."""

    def synchronised_elsewhere(self, module: torch.nn.Module) -> bool:
        """Whether another library keeps ``module``'s parameters consistent (FSDP2's gathered ones)."""
        return False

    def state_to_restore(self, obj: Any, saved: Any) -> Any:
        """``saved`` as ``obj.load_state_dict`` takes it under this synchronisation (a shard, for one)."""
        return saved

    def close(self) -> None:
        """Detaches everything (the strategy is closing)."""


class ReducerSync(GradientSync):
    """The part of the contract a sync over a bucket reducer (:class:`GradientReducer` or one
    like it, in ``self.reducer``, None until the first variables) answers the same way:
    :class:`AllReduce` and CentralStorage's ``Central``."""

    reducer: Any = None
    _guard: Any = None

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.reducer.no_sync() if self.reducer is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def scaled(self, factor: float) -> Iterator[None]:
        reducer = self.reducer
        if reducer is None or factor == 1.0:
            yield
            return
        previous, reducer.scale = reducer.scale, factor
        try:
            yield
        finally:
            reducer.scale = previous

    def scales(self, param: torch.Tensor) -> bool:
        return self.reducer is not None and self.reducer.holds(param)

    def parameters(self) -> list[torch.Tensor]:
        return self.reducer.parameters() if self.reducer is not None else []  # type: ignore[return-value]

    @property
    def passes(self) -> int:
        reducer = self.reducer
        return reducer.reductions + reducer.skipped if reducer is not None else 0

    def set_guard(self, guard: Any) -> None:
        self._guard = guard
        if self.reducer is not None:
            self.reducer.guard = guard

    def check_pending(self) -> None:
        if self.reducer is not None:
            self.reducer.check_pending()

    def close(self) -> None:
        if self.reducer is not None:
            try:
                self.reducer.check_pending()
            finally:
                self.reducer.remove()


class AllReduce(ReducerSync):
    """Sums every replica's gradients into every replica's ``.grad`` during backward.

    Args:
        comm: the communicator among the replicas.
        cross_device_ops: the all-reduce algorithm (``num_packs`` splits the buckets).
        bucket_bytes: the buckets' target size.
        guard: the consistency guard riding on the first bucket, or None.
        thawed: returns the synchronised parameters that were created frozen and train now (and
            forgets them): asked at the end of each backward pass, so that a parameter thawed
            inside ``run`` joins in that same step.
    """

    def __init__(
        self,
        comm: Communicator,
        cross_device_ops: CrossDeviceOps,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        guard: Any = None,
        thawed: Callable[[], list[torch.nn.Parameter]] | None = None,
    ) -> None:
        self._comm = comm
        self._ops = cross_device_ops
        self._bucket_bytes = bucket_bytes
        self._guard = guard
        self._thawed = thawed
        self.reducer: GradientReducer | None = None

    def attach(self, params: list[torch.nn.Parameter]) -> None:
        if self.reducer is not None:
            self.reducer.add(params, self._bucket_bytes, self._ops.num_packs)
            return
        comm, ops = self._comm, self._ops
        reduce = lambda flat: ops.all_reduce(comm, flat, "sum")  # noqa: E731
        rec = getattr(comm, "recorder", None)
        if rec is not None:  # the flight recorder calls these collectives gradient buckets
            reduce = rec.labelled("gradient bucket", reduce)
        self.reducer = GradientReducer(
            params,
            reduce,
            self._bucket_bytes,
            ops.num_packs,
            guard=self._guard,
            all_gather=comm.all_gather,
        )
        self.reducer.late = self._thawed
        # An elastic job's vote: every replica applies a pass's sums or none does (comm/elastic.py).
        self.reducer.commit = getattr(comm, "commit", None)
