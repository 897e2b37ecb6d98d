"""Which process writes a checkpoint, and the collectives that keep the processes in step.

Saving is collective: every process of the job calls ``save`` at the same point. Every process
collects its state (sharded variables may gather theirs), the chief writes (and a process given
a path of its own writes that one, see :meth:`Participants.writes`), and then all
take part in one small all-reduce that doubles as a barrier and tells everyone whether the
chief's write succeeded. Nobody returns from ``save`` before the checkpoint is complete on disk,
and a failed write raises on every process instead of hanging the others.

The strategy is found as TF's programs expect, wherever the Checkpoint was made (TF's
multi-worker tutorials make it outside ``scope()``), and the same on every process:

1. the one whose ``scope()`` is open at the call;
2. the one that was current when the :class:`~phalanx.checkpoint.Checkpoint` was created;
3. the one that owns the Checkpoint's variables (every strategy marks the variables created in
   its scope);
4. the live strategy of this process (the newest not closed), if it spans several processes
   (a Checkpoint of plain values);
5. else the default strategy (one process), unless the environment says this process belongs
   to a multi-process job: then every process would write the same files, and it is refused.

Example:
    >>> from phalanx.checkpoint.coordination import Participants
    >>> p = Participants.resolve(None, None)
    >>> p.is_writer, p.world_size, p.any(False)
    (True, 1, False)
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from phalanx.checkpoint.errors import CheckpointError
from phalanx.core import context


def _multi_process_environment() -> str | None:
    """A description of the multi-process job this process belongs to, if the environment says so."""
    from phalanx.launch import self_launch

    # Replica 0 of a self-launched job (`python train.py`) has no launcher environment: it is the
    # launcher. The launch layer says whether this process started replicas.
    current_job = getattr(self_launch, "current_job", None)
    job = current_job() if callable(current_job) else None
    if job is not None:
        return f"replica 0 of {getattr(job, 'world_size', 'several')} self-launched replicas"
    for var in ("PHALANX_WORLD_SIZE", "WORLD_SIZE"):
        if os.environ.get(var, "1").isdigit() and int(os.environ.get(var, "1")) > 1:
            return f"{var}={os.environ[var]}"
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
        tasks = sum(len(cluster.get(job, [])) for job in ("chief", "worker"))
    except (ValueError, AttributeError, TypeError):
        tasks = 0
    return f"TF_CONFIG with {tasks} tasks" if tasks > 1 else None


def find_strategy(captured: Any = None, owning: Any = None) -> Any:
    """The strategy a save or restore runs under (see the module docstring).

    Raises:
        CheckpointError: none is known in a process of a multi-process job.
    """
    if context.has_strategy():
        return context.get_strategy()
    if captured is not None:
        return captured
    if owning is not None:
        return owning
    from phalanx.core.strategy import live_strategy

    live = live_strategy()
    if live is not None and live.num_replicas_in_sync > 1:
        return live
    job = _multi_process_environment()
    if job is not None:
        raise CheckpointError(
            f"This process belongs to a multi-process job ({job}), but no strategy is known to the "
            "checkpoint, so every process would write the same files.",
            hint="create the strategy before saving; create the Checkpoint inside `with strategy.scope():`, "
            "or save inside it",
        )
    return context.get_strategy()


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
    def resolve(cls, captured: Any, owning: Any = None) -> "Participants":
        """The participants under the strategy found as the module docstring says.

        Args:
            captured: the strategy current when the Checkpoint was created, or None.
            owning: the strategy that owns the Checkpoint's variables, or None.

        Raises:
            CheckpointError: no strategy is known but the environment describes a multi-process
                job; every process would write the same files.
        """
        return cls(find_strategy(captured, owning))

    def writes(self, path: str) -> bool:
        """Whether this process writes ``path`` (a collective: every process calls it).

        The chief writes; so does a process whose ``path`` differs from the chief's: TF's
        multi-worker tutorials give non-chief workers a temporary path of their own
        (``write_filepath``), save there and delete it, so it must exist as in TF. A path shared
        with the chief is written once, by the chief.
        """
        if self.world_size == 1:
            return self.is_writer
        digest = int.from_bytes(hashlib.sha256(path.encode()).digest()[:7], "big")
        chiefs = torch.tensor([digest if self.is_writer else 0], dtype=torch.int64, device=self._device)
        self._extended.broadcast([chiefs])  # the chief is process 0 of a synchronous strategy
        return self.is_writer or int(chiefs[0]) != digest

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any process (a collective; also a barrier)."""
        if self.world_size == 1:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._device)
        return bool(self._extended.all_reduce([t], "sum")[0].item() > 0)

    def exchange(self, value: Any) -> list[Any]:
        """Every process's ``value`` (anything JSON holds), in process order (a collective).

        JSON, not pickle: what another process sends is data, never code.
        """
        if self.world_size == 1:
            return [value]
        line = json.dumps(value).encode() + b"\n"  # one line each: JSON escapes its newlines
        mine = torch.frombuffer(bytearray(line), dtype=torch.uint8).to(self._device)
        gathered = bytes(self._extended.all_gather(mine).cpu().numpy())  # lengths may differ
        return [json.loads(part) for part in gathered.split(b"\n")[:-1]]

    def describe(self) -> dict[str, Any]:
        return {"strategy": type(self.strategy).__name__, "num_replicas_in_sync": self.world_size}
