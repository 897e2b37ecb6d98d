"""Self-healing checkpoints (issue 13 item 9): a damaged latest checkpoint is skipped, loudly.

Choosing the latest checkpoint verifies it against its manifest (size and SHA-256 of every file);
``latest_checkpoint()``, ``CheckpointManager.latest_checkpoint`` and ``restore_or_initialize()``
fall back to the newest valid one and log a warning naming each checkpoint skipped and why.
The multi-process case (a restart under ``phalanx run --max-restarts 2``) is in
test_checkpoint_recovery.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import (
    Checkpoint,
    CheckpointManager,
    CorruptCheckpointError,
    Counter,
    latest_checkpoint,
    storage,
)


def _damage(path: str, how: str, file: str = "w.pt") -> str:
    """Damages one file of the checkpoint at ``path``; returns the reason a warning must give."""
    target = Path(path, file)
    if how == "bit_flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
        target.write_bytes(bytes(data))
        return "SHA-256"
    if how == "truncated":
        with open(target, "r+b") as f:
            f.truncate(target.stat().st_size // 2)
        return "truncated"
    if how == "missing":
        target.unlink()
        return "missing"
    raise AssertionError(how)


def _three_saves(directory: Path) -> tuple[list[str], Checkpoint]:
    w, step = torch.zeros(64), Counter()
    ckpt = Checkpoint(w=w, step=step)
    manager = CheckpointManager(ckpt, str(directory), max_to_keep=3)
    paths = []
    for _ in range(3):
        step.assign_add(1)
        w += 1
        paths.append(manager.save())
    return paths, ckpt


def _skips(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "phalanx.checkpoint" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("how", ["bit_flip", "truncated", "missing"])
def test_latest_checkpoint_falls_back_to_the_newest_valid_one_and_says_why(tmp_path, caplog, how):
    paths, _ = _three_saves(tmp_path)
    reason = _damage(paths[2], how)
    caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
    assert latest_checkpoint(str(tmp_path)) == paths[1]
    warnings = _skips(caplog)
    assert len(warnings) == 1, warnings
    assert paths[2] in warnings[0] and "w.pt" in warnings[0] and reason in warnings[0], warnings[0]


@pytest.mark.parametrize("how", ["bit_flip", "truncated", "missing"])
def test_restore_or_initialize_resumes_from_the_previous_valid_checkpoint(tmp_path, caplog, how):
    paths, _ = _three_saves(tmp_path)
    reason = _damage(paths[2], how)
    caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
    w, step = torch.full((64,), -1.0), Counter()
    ckpt = Checkpoint(w=w, step=step)
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=3)
    assert manager.restore_or_initialize() == paths[1]
    assert step == 2 and torch.equal(w, torch.full((64,), 2.0)) and int(ckpt.save_counter) == 2
    warnings = _skips(caplog)
    assert len(warnings) == 1 and paths[2] in warnings[0] and reason in warnings[0], warnings
    assert manager.latest_checkpoint == paths[1]
    # Training goes on: the next save takes the damaged one's number and replaces it.
    assert manager.save() == paths[2]
    assert latest_checkpoint(str(tmp_path)) == paths[2] and not _skips(caplog)[1:]


def test_a_damaged_latest_checkpoint_is_reported_once_per_process(tmp_path, caplog):
    paths, _ = _three_saves(tmp_path)
    _damage(paths[2], "bit_flip")
    caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
    for _ in range(3):  # e.g. a training loop that asks at every epoch
        assert latest_checkpoint(str(tmp_path)) == paths[1]
    assert len(_skips(caplog)) == 1, _skips(caplog)
    storage.forget_verified()  # a new process says it again
    assert latest_checkpoint(str(tmp_path)) == paths[1] and len(_skips(caplog)) == 2


def test_every_skipped_checkpoint_is_named(tmp_path, caplog):
    paths, _ = _three_saves(tmp_path)
    _damage(paths[2], "bit_flip")
    _damage(paths[1], "missing")
    caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
    assert latest_checkpoint(str(tmp_path)) == paths[0]
    warnings = _skips(caplog)
    assert len(warnings) == 2 and paths[2] in warnings[0] and paths[1] in warnings[1], warnings


def test_nothing_valid_left_initializes_with_warnings(tmp_path, caplog):
    paths, _ = _three_saves(tmp_path)
    for path in paths:
        _damage(path, "bit_flip")
    caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
    calls = []
    manager = CheckpointManager(
        Checkpoint(w=torch.zeros(64), step=Counter()), str(tmp_path), max_to_keep=3, init_fn=lambda: calls.append(1)
    )
    assert manager.restore_or_initialize() is None and calls == [1]
    assert len(_skips(caplog)) == 3


def test_restoring_a_damaged_checkpoint_by_path_still_raises(tmp_path):
    """An explicit path is the user's choice: no silent substitute."""
    paths, ckpt = _three_saves(tmp_path)
    _damage(paths[2], "bit_flip")
    with pytest.raises(CorruptCheckpointError, match="SHA-256"):
        ckpt.restore(paths[2])


def test_verification_reads_each_file_once_per_choice(tmp_path, monkeypatch):
    """Hash while writing, verify once on choose: choosing then restoring hashes each file once."""
    _three_saves(tmp_path)
    storage.forget_verified()  # as a fresh process would start
    hashed = []
    real = storage._digest

    def counting(chunks):
        hashed.append(1)
        return real(chunks)

    monkeypatch.setattr(storage, "_digest", counting)
    ckpt = Checkpoint(w=torch.zeros(64), step=Counter())
    ckpt.restore(latest_checkpoint(str(tmp_path)))
    assert len(hashed) == 1  # one tensor file, hashed when chosen, not again when restored
    # A save hashes the bytes it writes, once, and does not read them back.
    hashed.clear()
    ckpt.save(str(tmp_path / "again"))
    assert len(hashed) == 1
