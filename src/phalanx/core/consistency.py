"""The consistency guard's switch, and what it reads at each step (``extended.consistency``).

Replicas are processes here, so they can drift apart as TF's replicas of one program cannot: the
guard (:class:`phalanx.comm.guard.ReplicaGuard`) rides on every collective with the step, the
global batch, and now and then a fingerprint of the synchronised parameters. This object says
whether it runs, and gives it its fields.

Example:
    >>> import phalanx as px
    >>> strategy = px.OneDeviceStrategy("cpu")
    >>> strategy.extended.consistency.active is None  # one replica: nothing to compare
    True
"""

from __future__ import annotations

from typing import Callable

import torch

from phalanx import config
from phalanx.comm.communicator import Communicator
from phalanx.comm.guard import ReplicaGuard
from phalanx.core import capture
from phalanx.input import global_batch


class ConsistencyChecks:
    """Whether the guard runs, and what it reads.

    Args:
        comm: the communicator the guard's values travel with.
        step: the step the job is at (``strategy.run`` calls so far).
        parameters: the synchronised parameters, in the order every replica agrees on.
        enabled: build a guard (several replicas, or a process group built at world size 1).
    """

    def __init__(
        self,
        comm: Communicator,
        step: Callable[[], int],
        parameters: Callable[[], list[torch.Tensor]],
        enabled: bool,
    ) -> None:
        self._step = step
        self._parameters = parameters
        settings = config.settings()
        every, check = settings.fingerprint_every, settings.guard_every
        #: The guard that runs, or None (one replica, or turned off by ``set``).
        self.active: ReplicaGuard | None = (
            ReplicaGuard(comm, self.fields, self.labelled, every, check) if enabled else None
        )
        self._off: ReplicaGuard | None = None  # the guard turned off, kept to be turned on again

    @property
    def checks(self) -> int:
        """How many collectives the guard has checked so far (0 without one)."""
        guard = self.active if self.active is not None else self._off
        return guard.checks if guard is not None else 0

    def set(self, enabled: bool, fingerprint_every: int | None = None) -> ReplicaGuard | None:
        """Turns the guard on or off (see ``StrategyExtended.set_consistency_checks``); returns the active one.

        Raises:
            ValueError: ``fingerprint_every`` is not a non-negative integer.
        """
        if fingerprint_every is not None and (
            isinstance(fingerprint_every, bool) or not isinstance(fingerprint_every, int) or fingerprint_every < 0
        ):
            raise ValueError(f"fingerprint_every must be a non-negative integer; received {fingerprint_every!r}")
        guard = self.active if self.active is not None else self._off
        if guard is None:
            return None
        if fingerprint_every is not None:
            guard.every = fingerprint_every
        self.active, self._off = (guard, None) if enabled else (None, guard)
        return self.active

    def regrouped(self) -> None:
        """An elastic job's group re-formed (see :meth:`ReplicaGuard.regrouped`)."""
        for guard in (self.active, self._off):
            if guard is not None:
                guard.regrouped()

    def mark_changed(self) -> None:
        """The parameters were changed outside training: the next collective fingerprints them."""
        if self.active is not None:
            self.active.fingerprint_due = True

    def fields(self) -> tuple[int, int, int]:
        """The step, the size of the global batch this process sliced, and that batch's ordinal."""
        info = global_batch.current()
        if info is None:
            return (self._step(), 0, 0)
        # The batch each process sliced (where every process reads whole global batches) must be
        # the same size everywhere; an agreed sum over per-process pipelines would hide the difference.
        sliced = info.sliced_from if info.sliced_from is not None else info.global_size
        return (self._step(), sliced, info.ordinal)

    def labelled(self) -> list[tuple[str, torch.Tensor]]:
        """The synchronised parameters with their names, for the fingerprint (a mismatch names one)."""
        return [(capture.label_of(p), p) for p in self._parameters()]
