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

Fault injection for tests: ``PHALANX_CHECKPOINT_FAULT=after_file:K`` ends the process with
:data:`FAULT_EXIT_CODE` right after the K-th file of a save is written, ``before_commit`` after
the manifest is written but before the directory is renamed into place.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import time
import uuid
from typing import Any

import torch

from phalanx.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

MANIFEST = "MANIFEST.json"
FORMAT = "phalanx.checkpoint"
VERSION = 1
FAULT_ENV = "PHALANX_CHECKPOINT_FAULT"
FAULT_EXIT_CODE = 75


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
    fault = os.environ.get(FAULT_ENV)
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
            records[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            _fault_point("after_file", i)
        previous = [m.get("sequence", 0) for _, m in list_checkpoints(parent)]
        full = {"format": FORMAT, "version": VERSION, "sequence": max(previous, default=0) + 1,
                "created_ns": time.time_ns(), **manifest, "files": records}
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
        raise CheckpointNotFoundError(path, hint=f"format version {manifest.get('version')!r} is not "
                                                 f"{VERSION}; use the phalanx version that wrote it")
    return manifest


def is_complete(path: str) -> bool:
    """Whether ``path`` holds a checkpoint whose manifest and files are all present."""
    try:
        manifest = read_manifest(path)
        return all(os.path.getsize(os.path.join(path, name)) == rec["bytes"]
                   for name, rec in manifest["files"].items())
    except (CheckpointNotFoundError, OSError, KeyError, TypeError):
        return False


def list_checkpoints(directory: str) -> list[tuple[str, dict[str, Any]]]:
    """Complete checkpoints directly under ``directory``, oldest first: ``[(path, manifest)]``."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        path = os.path.join(os.path.abspath(directory), name)
        if name.startswith(".") or not os.path.isdir(path) or not is_complete(path):
            continue
        manifest = read_manifest(path)
        found.append((path, manifest))
    found.sort(key=lambda pm: (pm[1].get("sequence", 0), pm[1].get("created_ns", 0), pm[0]))
    return found


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
    if hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise CorruptCheckpointError(file, "its SHA-256 differs from the manifest's")
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(file, str(e).strip().splitlines()[0][:200]) from e
    except (RuntimeError, EOFError, ValueError) as e:  # not a torch.save file at all
        raise CorruptCheckpointError(file, f"not a tensor file ({str(e).strip()[:200]})") from e
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise UnsafeCheckpointError(file, "it holds something other than a {name: tensor} dict")
    return tensors
