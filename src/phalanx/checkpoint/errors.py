"""Typed errors of :mod:`phalanx.checkpoint`.

Each names the checkpoint (and, where it applies, the object and key) it is about, and says what
to do, in the style of :mod:`phalanx.errors`.

Example:
    >>> from phalanx.checkpoint.errors import CheckpointNotFoundError
    >>> try:
    ...     raise CheckpointNotFoundError("/tmp/none/ckpt-3")
    ... except FileNotFoundError as e:
    ...     print(str(e).split(" HINT")[0])
    No valid checkpoint at '/tmp/none/ckpt-3' (its MANIFEST.json is missing or incomplete).
"""

from __future__ import annotations

from typing import Any

from phalanx.errors import PhalanxError


class CheckpointError(PhalanxError, RuntimeError):
    """Base class of checkpoint errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """``restore`` was given a path that holds no complete checkpoint."""

    def __init__(self, path: str, *, hint: str | None = None) -> None:
        self.path = path
        super().__init__(
            f"No valid checkpoint at {path!r} (its MANIFEST.json is missing or incomplete).",
            hint=hint or "pass a path returned by save(), or phalanx.checkpoint.latest_checkpoint(directory)",
        )


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file does not match the size or checksum its manifest recorded."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"Checkpoint file {path!r} is damaged: {problem}.",
            hint="restore an older checkpoint (CheckpointManager.checkpoints lists them)",
        )


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something other than tensors (e.g. a pickled object); refused."""

    def __init__(self, path: str, cause: str) -> None:
        self.path = path
        super().__init__(
            f"Refused to load {path!r}: it is not a tensors-only file ({cause}). Nothing from it was executed.",
            hint="checkpoints hold tensors and JSON only; never load files from an untrusted source",
        )


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint's contents do not fit the object they are restored into."""

    def __init__(self, name: str, problem: str, *, hint: str | None = None) -> None:
        self.name = name
        super().__init__(f"Cannot restore {name!r}: {problem}.", hint=hint)


class UnsupportedStateError(CheckpointError, TypeError):
    """An object or state value that a checkpoint cannot hold."""

    def __init__(self, path: str, value: Any) -> None:
        self.path = path
        self.value = value
        super().__init__(
            f"Cannot checkpoint {path!r}: values of type {type(value).__name__} are not supported "
            f"(received {value!r:.80}).",
            hint="checkpoints hold tensors, numbers, strings, None, lists, tuples and dicts of them; give "
            "other objects state_dict()/load_state_dict() methods",
        )
