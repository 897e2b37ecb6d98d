"""The on-disk format: a directory of tensor files and a JSON manifest, committed atomically.

A checkpoint is a directory (``/ckpts/ckpt-7``)::

    ckpt-7/
      model.pt          {state_dict key: tensor}, written with torch.save
      optimizer.pt      {"state/0/exp_avg": tensor, ...}
      MANIFEST.json     structure and non-tensor values of every object, file sizes and SHA-256

Why not ``torch.distributed.checkpoint`` (DCP)? Its ``FileSystemReader`` reads the ``.metadata``
file with ``pickle.load`` and its ``DefaultLoadPlanner`` reads non-tensor values with
``torch.load(weights_only=False)`` (torch 2.13, ``checkpoint/filesystem.py`` and
``default_planner.py``): loading a DCP checkpoint can run code from the file. Here every byte
that is not JSON goes through ``torch.load(weights_only=True)``, whose unpickler accepts tensors
and plain containers only, and the manifest is JSON. What DCP offers beyond that, load-time
resharding, comes from storing *full* tensors: parameters are mirrored, and sharded variables are
concatenated on save (:mod:`phalanx.checkpoint.sharding`), so any world size or shard count can
restore them. A module's file is its ``state_dict``, readable with plain ``torch.load``.

Writing is atomic. The chief writes every file into a hidden temporary directory, fsyncs each,
writes the manifest last (temp file, fsync, ``os.replace``), then renames the directory into
place and fsyncs the parent. A crash at any point leaves either no new checkpoint or a complete
one; only directories with a valid manifest are checkpoints.

Reading verifies. Choosing a checkpoint (:func:`choose_latest`, behind ``latest_checkpoint`` and
``CheckpointManager.restore_or_initialize``) checks every file against the manifest, size and
SHA-256, newest checkpoint first, and skips a damaged one with a warning that names it and why
(a flipped bit of the same size, a truncated or a missing file), so a job that restarts after
its storage damaged the latest save resumes from the previous one instead of crash-looping.
The cost stays at one hash per file: the writer hashes the bytes it writes (never reading them
back), and a file verified when chosen is not hashed again by the restore that follows, as long
as its size, times and inode are unchanged (:class:`VerifiedFiles`).

Fault injection for tests: ``PHALANX_CHECKPOINT_FAULT=after_file:K`` ends the process with
:data:`FAULT_EXIT_CODE` right after the K-th file of a save is written, ``before_commit`` after
the manifest is written but before the directory is renamed into place.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import time
import uuid
from typing import Any, Iterable, Iterator

import torch

from phalanx.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from phalanx.config import settings

MANIFEST = "MANIFEST.json"
FORMAT = "phalanx.checkpoint"
VERSION = 1
FAULT_ENV = "PHALANX_CHECKPOINT_FAULT"
FAULT_EXIT_CODE = 75
_CHUNK = 8 << 20  # bytes hashed at a time when verifying a file

log = logging.getLogger("phalanx.checkpoint")


# --------------------------------------------------------------------------- checksums
def _digest(chunks: Iterable[bytes]) -> str:
    """The SHA-256 of the concatenated chunks (the only place checkpoint bytes are hashed)."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _file_chunks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


class VerifiedFiles:
    """Files whose checksum this process has already established, so it is computed once.

    A file is known by its path, size, modification and change times and inode: any write to
    it (even one that keeps the size) changes its times, so a remembered file is the same bytes.
    Bounded: the oldest entries are forgotten first.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._known: dict[tuple, str] = {}
        self._capacity = capacity

    @staticmethod
    def _key(path: str) -> tuple | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def remember(self, path: str, sha256: str) -> None:
        key = self._key(path)
        if key is None:
            return
        self._known.pop(key, None)
        self._known[key] = sha256
        while len(self._known) > self._capacity:
            self._known.pop(next(iter(self._known)))

    def matches(self, path: str, sha256: str) -> bool:
        key = self._key(path)
        return key is not None and self._known.get(key) == sha256

    def clear(self) -> None:
        self._known.clear()


# One per process: checksums are facts about files, shared by every Checkpoint and manager.
_verified = VerifiedFiles()


# (checkpoint, problem) pairs already reported: a damaged checkpoint that stays the newest one on
# disk is skipped again at every latest_checkpoint() call, but said once per process.
_warned: set[tuple[str, str]] = set()


def forget_verified() -> None:
    """Forgets which files were verified and which were reported damaged (as a new process would); for tests."""
    _verified.clear()
    _warned.clear()


# --------------------------------------------------------------------------- durable writes
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file, fsync and ``os.replace``."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fault_point(name: str, index: int = 0) -> None:
    fault = settings().checkpoint_fault  # PHALANX_CHECKPOINT_FAULT
    if fault and (fault == name or fault == f"{name}:{index}"):
        os._exit(FAULT_EXIT_CODE)


def serialize_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def write_checkpoint(path: str, files: dict[str, dict[str, torch.Tensor]], manifest: dict[str, Any]) -> str:
    """Writes a checkpoint directory at ``path`` atomically; returns ``path``.

    Args:
        files: file name -> the tensors it holds.
        manifest: the manifest's content; ``files``, ``format``, ``version`` and ``sequence`` are added.
    """
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        records = {}
        for i, (name, tensors) in enumerate(files.items(), start=1):
            data = serialize_tensors(tensors)
            write_durable(os.path.join(tmp, name), data)
            records[name] = {"bytes": len(data), "sha256": _digest([data])}  # hashed while writing
            _fault_point("after_file", i)
        previous = [m.get("sequence", 0) for _, m in list_checkpoints(parent)]
        full = {
            "format": FORMAT,
            "version": VERSION,
            "sequence": max(previous, default=0) + 1,
            "created_ns": time.time_ns(),
            **manifest,
            "files": records,
        }
        write_durable(os.path.join(tmp, MANIFEST), json.dumps(full, indent=1).encode())
        _fsync_dir(tmp)
        _fault_point("before_commit")
        trash = None
        if os.path.lexists(path):  # overwriting: a directory cannot be renamed onto a non-empty one
            trash = os.path.join(parent, f".{os.path.basename(path)}.trash-{uuid.uuid4().hex[:8]}")
            os.replace(path, trash)
        try:
            os.replace(tmp, path)
        except BaseException:
            if trash is not None:
                os.replace(trash, path)
            raise
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return path


def delete_checkpoint(path: str) -> None:
    """Deletes a checkpoint; the manifest goes first, so a crash midway leaves no valid half."""
    try:
        os.remove(os.path.join(path, MANIFEST))
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def remove_leftovers(directory: str) -> None:
    """Removes temporary and half-deleted directories that crashed saves left in ``directory``."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(".") and (".tmp-" in name or ".trash-" in name):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


# --------------------------------------------------------------------------- reading
def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``; raises if it is not a complete checkpoint."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointNotFoundError(path) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointNotFoundError(path, hint="this directory was not written by phalanx.checkpoint")
    if manifest.get("version") != VERSION:
        raise CheckpointNotFoundError(
            path,
            hint=f"format version {manifest.get('version')!r} is not {VERSION}; use the phalanx version that wrote it",
        )
    return manifest


def find_problem(path: str, manifest: dict[str, Any] | None = None) -> str | None:
    """Why the checkpoint at ``path`` cannot be restored, or None when every file is intact.

    Checks each file the manifest records: present, of the recorded size, of the recorded
    SHA-256 (skipped for a file this process verified or wrote and nobody touched since).
    """
    try:
        manifest = read_manifest(path) if manifest is None else manifest
        records = dict(manifest["files"])
    except CheckpointNotFoundError:
        return f"its {MANIFEST} is missing or unreadable"
    except (KeyError, TypeError, ValueError):
        return f"its {MANIFEST} records no valid file list"
    for name, record in records.items():
        file = os.path.join(path, name)
        try:
            size = os.path.getsize(file)
        except OSError:
            return f"{name} is missing"
        expected = record.get("bytes") if isinstance(record, dict) else None
        if size != expected:
            what = "truncated" if isinstance(expected, int) and size < expected else "of the wrong size"
            return f"{name} is {what}: {size} bytes, the manifest records {expected}"
        if _verified.matches(file, record.get("sha256")):
            continue
        try:
            actual = _digest(_file_chunks(file))
        except OSError as e:
            return f"{name} cannot be read ({e})"
        if actual != record.get("sha256"):
            return (
                f"{name} has the right size but its SHA-256 differs from the manifest's (its bytes changed "
                "after it was written: a flipped bit, a partial overwrite)"
            )
        _verified.remember(file, actual)
    return None


def is_complete(path: str) -> bool:
    """Whether ``path`` holds a checkpoint whose manifest and files are all present (sizes only)."""
    try:
        manifest = read_manifest(path)
        return all(os.path.getsize(os.path.join(path, name)) == rec["bytes"] for name, rec in manifest["files"].items())
    except (CheckpointNotFoundError, OSError, KeyError, TypeError):
        return False


def list_checkpoints(directory: str) -> list[tuple[str, dict[str, Any]]]:
    """Checkpoints directly under ``directory`` with a valid manifest, oldest first: ``[(path, manifest)]``.

    Their files are not checked here (:func:`choose_latest` does that, for the ones it considers).
    """
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        path = os.path.join(os.path.abspath(directory), name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        try:
            found.append((path, read_manifest(path)))
        except CheckpointNotFoundError:
            continue  # not a checkpoint (or a save that crashed before its manifest)
    found.sort(key=lambda pm: (pm[1].get("sequence", 0), pm[1].get("created_ns", 0), pm[0]))
    return found


def choose_latest(candidates: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest intact checkpoint of ``candidates`` (oldest first), and those skipped on the way.

    Each skipped checkpoint is logged as a warning (logger ``phalanx.checkpoint``) with the reason,
    the first time this process skips it.

    Returns:
        ``(path or None, [(skipped path, reason), ...])``.
    """
    skipped: list[tuple[str, str]] = []
    for path in reversed(candidates):
        problem = find_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
        warn_skipped(path, problem)
    return None, skipped


def warn_skipped(path: str, problem: str) -> None:
    """Logs that the damaged checkpoint ``path`` was skipped and why, once per checkpoint, problem and process."""
    key = (os.path.abspath(path), problem)
    if key in _warned:
        return
    _warned.add(key)
    log.warning(
        "phalanx.checkpoint: skipped the damaged checkpoint %r: %s. Falling back to the previous "
        "valid checkpoint; the training saved in this one is lost and will be redone.",
        path,
        problem,
    )


def load_tensors(path: str, name: str, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Loads one tensor file of a checkpoint, checking its size and checksum; never runs code."""
    file = os.path.join(path, name)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CorruptCheckpointError(file, f"cannot be read ({e})") from e
    if len(data) != record.get("bytes"):
        raise CorruptCheckpointError(file, f"{len(data)} bytes, the manifest says {record.get('bytes')}")
    # A file verified when it was chosen a moment ago is not hashed twice.
    if not _verified.matches(file, record.get("sha256")) and _digest([data]) != record.get("sha256"):
        raise CorruptCheckpointError(file, "its SHA-256 differs from the manifest's")
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(file, str(e).strip().splitlines()[0][:200]) from e
    except (RuntimeError, EOFError, ValueError) as e:  # not a torch.save file at all
        raise CorruptCheckpointError(file, f"not a tensor file ({str(e).strip()[:200]})") from e
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise UnsafeCheckpointError(file, "it holds something other than a {name: tensor} dict")
    return tensors
