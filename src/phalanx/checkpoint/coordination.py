"""Which process writes a checkpoint, and the collectives that keep the processes in step.

Saving is collective: every process of the job calls ``save`` at the same point. Every process
collects its state (sharded variables may gather theirs), the chief alone writes, and then all
take part in one small all-reduce that doubles as a barrier and tells everyone whether the
chief's write succeeded. Nobody returns from ``save`` before the checkpoint is complete on disk,
and a failed write raises on every process instead of hanging the others.

The strategy is the one whose ``scope()`` is open at the call, else the one that was current when
the :class:`~phalanx.checkpoint.Checkpoint` was created, else the default strategy (one process).

Example:
    >>> from phalanx.checkpoint.coordination import Participants
    >>> p = Participants.resolve(None)
    >>> p.is_writer, p.world_size, p.any(False)
    (True, 1, False)
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from phalanx import context
from phalanx.checkpoint.errors import CheckpointError


def _multi_process_environment() -> str | None:
    """A description of the multi-process job this process belongs to, if the environment says so."""
    for var in ("PHALANX_WORLD_SIZE", "WORLD_SIZE"):
        if os.environ.get(var, "1").isdigit() and int(os.environ.get(var, "1")) > 1:
            return f"{var}={os.environ[var]}"
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
        tasks = sum(len(cluster.get(job, [])) for job in ("chief", "worker"))
    except (ValueError, AttributeError, TypeError):
        tasks = 0
    return f"TF_CONFIG with {tasks} tasks" if tasks > 1 else None


class Participants:
    """The processes taking part in a save, seen from this one."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        ext = strategy.extended
        self._extended = ext
        self.rank = int(ext.process_index)
        self.world_size = int(ext.num_processes)
        self.is_writer = bool(ext.should_checkpoint)
        self._device = ext.device

    @classmethod
    def resolve(cls, captured: Any) -> "Participants":
        """The participants under the current strategy (see the module docstring).

        Raises:
            CheckpointError: no strategy is known but the environment describes a multi-process
                job; every process would write the same files.
        """
        if context.has_strategy():
            strategy = context.get_strategy()
        elif captured is not None:
            strategy = captured
        else:
            strategy = context.get_strategy()
            job = _multi_process_environment()
            if job is not None:
                raise CheckpointError(
                    f"This process belongs to a multi-process job ({job}), but no strategy is known to the "
                    "checkpoint, so every process would write the same files.",
                    hint="create the Checkpoint inside `with strategy.scope():`, or save inside it")
        return cls(strategy)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any process (a collective; also a barrier)."""
        if self.world_size == 1:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._device)
        return bool(self._extended.all_reduce([t], "sum")[0].item() > 0)

    def describe(self) -> dict[str, Any]:
        return {"strategy": type(self.strategy).__name__, "num_replicas_in_sync": self.world_size}
