"""``CheckpointManager``: numbered checkpoints in one directory, the oldest deleted beyond a limit.

As ``tf.train.CheckpointManager``. The manager finds the checkpoints a previous run left (a
restarted job continues the numbering and the deletion), and a save that crashed leaves nothing
it would pick up: only directories with a manifest count. The latest checkpoint is verified
before it is used, every byte of it; a damaged one (a flipped bit anywhere, a truncated or
missing file, an unparsable manifest) is skipped with a warning, and the previous valid one is
used instead.

Example:
    >>> import tempfile, torch
    >>> from phalanx.checkpoint import Checkpoint, CheckpointManager
    >>> ckpt = Checkpoint(model=torch.nn.Linear(2, 1))
    >>> manager = CheckpointManager(ckpt, tempfile.mkdtemp(), max_to_keep=2)
    >>> paths = [manager.save() for _ in range(3)]
    >>> [p.rsplit("/", 1)[1] for p in manager.checkpoints]
    ['ckpt-2', 'ckpt-3']
    >>> manager.latest_checkpoint == paths[-1]
    True
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from phalanx.checkpoint import storage
from phalanx.checkpoint.checkpoint import Checkpoint
from phalanx.checkpoint.errors import CorruptCheckpointError


class CheckpointManager:
    """Saves numbered checkpoints of ``checkpoint`` in ``directory`` and keeps the newest ones.

    Args:
        checkpoint: the :class:`~phalanx.checkpoint.Checkpoint` to save and restore.
        directory: where the checkpoints go (created on the first save).
        max_to_keep: how many checkpoints to keep; None keeps all.
        checkpoint_name: the checkpoints are ``{directory}/{checkpoint_name}-{number}``.
        step_counter, checkpoint_interval: with both, ``save()`` only saves when the counter
            (anything ``int()`` accepts) advanced by at least ``checkpoint_interval`` since the
            last save.
        init_fn: called by :meth:`restore_or_initialize` when there is nothing to restore.

    Raises:
        ValueError: ``max_to_keep`` is not None or a positive integer, or ``checkpoint_name``
            is not a plain file name.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str,
        max_to_keep: int | None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"CheckpointManager needs a phalanx.checkpoint.Checkpoint; received {type(checkpoint).__name__}"
            )
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be None or a positive integer; received {max_to_keep!r}")
        if not checkpoint_name or os.sep in checkpoint_name or checkpoint_name.startswith("."):
            raise ValueError(f"checkpoint_name must be a plain file name; received {checkpoint_name!r}")
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError("checkpoint_interval needs a step_counter")
        self._checkpoint = checkpoint
        self._directory = os.path.abspath(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._pattern = re.compile(re.escape(checkpoint_name) + r"-(\d+)")
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        # A restarted job picks up where the last one left the directory. Checkpoints whose
        # manifest is damaged stay in the order (the newest one is reported when it is passed
        # over) but are not listed, kept or restored.
        entries = [e for e in storage.scan(self._directory) if self._pattern.fullmatch(os.path.basename(e.path))]
        self._checkpoints = [e.path for e in entries]
        self._damaged = {e.path for e in entries if e.problem is not None}
        self._last_saved_step: int | None = None

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoints, oldest first (not those found damaged)."""
        return [p for p in self._checkpoints if p not in self._damaged]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest intact checkpoint this manager knows of, or None.

        Verified against its manifest (once per file and process); damaged ones are skipped with
        a warning and dropped from :attr:`checkpoints`.
        """
        latest, skipped = storage.choose_latest(self._checkpoints)
        self._drop([path for path, _ in skipped])
        return latest

    def _drop(self, damaged: list[str]) -> None:
        # Left on disk for inspection; a later save with the same number replaces them.
        self._checkpoints = [p for p in self._checkpoints if p not in damaged]
        self._damaged.difference_update(damaged)

    def save(self, checkpoint_number: int | None = None, check_interval: bool = True) -> str | None:
        """Saves ``{directory}/{checkpoint_name}-{number}`` (collective); returns its path.

        Args:
            checkpoint_number: the number in the name; default: the checkpoint's ``save_counter``
                after counting this save.
            check_interval: honour ``checkpoint_interval`` (False saves regardless).

        Returns:
            The path, or None when the interval said not to save yet.
        """
        step = int(self._step_counter) if self._step_counter is not None else None
        if (
            check_interval
            and self._interval is not None
            and self._last_saved_step is not None
            and step - self._last_saved_step < self._interval
        ):
            return None
        counter = self._checkpoint.save_counter.assign_add(1)
        number = counter if checkpoint_number is None else int(checkpoint_number)
        path = os.path.join(self._directory, f"{self._name}-{number}")
        kept = [p for p in self._checkpoints if p != path] + [path]
        valid = [p for p in kept if p not in self._damaged or p == path]
        dropped = valid[: -self._max_to_keep] if self._max_to_keep is not None else []
        if dropped:  # damaged ones older than every kept checkpoint can never be chosen: they go too
            oldest_kept = kept.index(valid[len(dropped)])
            dropped += [p for p in kept[:oldest_kept] if p in self._damaged]

        def delete_old() -> None:
            # Only once the new checkpoint is complete: a crash before this point leaves the old ones.
            for old in dropped:
                storage.delete_checkpoint(old)
            storage.remove_leftovers(self._directory)

        self._checkpoint.write(path, _after_commit=delete_old)
        self._checkpoints = [p for p in kept if p not in dropped]
        self._damaged.difference_update([*dropped, path])  # deleted, or replaced by the save
        self._last_saved_step = step
        return path

    def restore_or_initialize(self) -> str | None:
        """Restores the latest intact checkpoint and returns its path, else calls ``init_fn`` and returns None.

        A damaged checkpoint is skipped with a warning naming it and why, and the one before it
        is restored, so a job whose latest save was damaged resumes instead of failing on every
        restart.
        """
        while (latest := self.latest_checkpoint) is not None:
            try:
                self._checkpoint.restore(latest)
            except CorruptCheckpointError as e:  # damaged after it was verified: try the one before
                storage.warn_skipped(latest, str(e))
                self._drop([latest])
                continue
            if self._step_counter is not None:
                self._last_saved_step = int(self._step_counter)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None
