"""Small checkpointable state: a step :class:`Counter` and the :class:`InputPosition`.

Both have ``state_dict()`` / ``load_state_dict()``, so a :class:`~phalanx.checkpoint.Checkpoint`
saves and restores them like a module or an optimizer.

Example (a resumable loop; ``dist_data`` is a distributed dataset of global batches)::

    step, position = Counter(), InputPosition()
    ckpt = Checkpoint(model=model, optimizer=optimizer, step=step, input=position)
    manager = CheckpointManager(ckpt, "/ckpts", max_to_keep=3)
    manager.restore_or_initialize()
    for epoch in position.epochs(EPOCHS):
        for batch in position.iterate(dist_data):   # skips the batches a restored run consumed
            strategy.run(train_step, args=(batch,))
            step.assign_add(1)
            manager.save()                           # after the step: the batch counts as consumed
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator, TypeVar

T = TypeVar("T")


@functools.total_ordering
class Counter:
    """An integer that is saved in checkpoints, like TF's ``tf.Variable(0, dtype=tf.int64)`` step.

    Example:
        >>> step = Counter()
        >>> step.assign_add(1)
        1
        >>> int(step), step == 1, step.state_dict()
        (1, True, {'value': 1})
    """

    def __init__(self, value: int = 0) -> None:
        self._value = _as_int(value, "value")

    @property
    def value(self) -> int:
        return self._value

    def assign(self, value: int) -> int:
        self._value = _as_int(value, "value")
        return self._value

    def assign_add(self, delta: int = 1) -> int:
        self._value += _as_int(delta, "delta")
        return self._value

    def numpy(self) -> int:
        """The value (TF's ``Variable.numpy()``)."""
        return self._value

    def __int__(self) -> int:
        return self._value

    __index__ = __int__

    def __eq__(self, other: object) -> bool:
        return self._value == (other._value if isinstance(other, Counter) else other)

    def __lt__(self, other: Any) -> bool:
        return self._value < (other._value if isinstance(other, Counter) else other)

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"Counter({self._value})"

    def state_dict(self) -> dict[str, int]:
        return {"value": self._value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._value = _as_int(state["value"], "value")


class InputPosition:
    """The epoch and how many batches of it were consumed, so a resumed run skips them.

    Batches count as consumed when :meth:`iterate` hands them out; save *after* the step that
    used them. Positions count global batches (steps), so they mean the same under any number
    of replicas or workers as long as every worker reads the same global batches (the default
    ``AutoShardPolicy.DATA``). Resuming replays the input exactly when each epoch's order is
    deterministic: seed its shuffling with the epoch (``torch.Generator().manual_seed(seed + epoch)``).

    Example:
        >>> position = InputPosition(epoch=0, batch=2)
        >>> list(position.iterate(["a", "b", "c", "d"]))
        ['c', 'd']
        >>> position.epoch, position.batch
        (1, 0)
    """

    def __init__(self, epoch: int = 0, batch: int = 0) -> None:
        self.epoch = _as_int(epoch, "epoch")
        self.batch = _as_int(batch, "batch")

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Yields the epochs still to run: ``self.epoch`` up to ``num_epochs - 1``."""
        while self.epoch < num_epochs:
            epoch = self.epoch
            yield epoch
            if self.epoch == epoch:  # the body did not run a whole `iterate` pass
                self.epoch, self.batch = epoch + 1, 0

    def iterate(self, batches: Iterable[T]) -> Iterator[T]:
        """Iterates ``batches``, skipping the ``self.batch`` already consumed in this epoch.

        Skipped batches are read and dropped (on every replica, so collectives stay matched).
        When the iterable is exhausted the position moves to the next epoch.
        """
        iterator = iter(batches)
        for _ in range(self.batch):
            if next(iterator, _END) is _END:
                break
        else:
            for element in iterator:
                self.batch += 1
                yield element
        self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = _as_int(state["epoch"], "epoch")
        self.batch = _as_int(state["batch"], "batch")

    def __repr__(self) -> str:
        return f"InputPosition(epoch={self.epoch}, batch={self.batch})"


_END = object()


def _as_int(value: Any, what: str) -> int:
    try:
        as_int = int(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be an integer; received {value!r}") from None
    if as_int != value and not hasattr(value, "item"):
        raise TypeError(f"{what} must be an integer; received {value!r}")
    return as_int
