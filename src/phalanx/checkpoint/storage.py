"""The on-disk format: a directory of tensor files and a JSON manifest, committed atomically.

A checkpoint is a directory (``/ckpts/ckpt-7``)::

    ckpt-7/
      model.pt          {state_dict key: tensor}, written with torch.save
      optimizer.pt      {"state/0/exp_avg": tensor, ...}
      sharded/          only for DTensor state (FullyShardedStrategy): torch.distributed.checkpoint's
        __0_0.distcp    files, each replica's shards in its own file (:mod:`~phalanx.checkpoint.distributed`)
        __1_0.distcp
        .metadata       DCP's metadata (a pickle: phalanx never reads it)
        index.json      the same, as JSON: what phalanx reads
      MANIFEST.json     structure and non-tensor values of every object, file sizes and SHA-256
      MANIFEST.sha256   the manifest's own size and SHA-256 (and sequence number), written after it

Every tensor that is whole on this process is stored whole, so any world size or shard count
can restore it: parameters are mirrored, and phalanx's sharded variables are concatenated on save
(:mod:`phalanx.checkpoint.sharded_variables`). A module's file is its ``state_dict``, readable with plain
``torch.load``. DTensors (FullyShardedStrategy's shards) are the exception: no replica may hold a
whole one, so every replica writes its own shards with ``torch.distributed.checkpoint`` (DCP)
into ``sharded/``, which reshards on load. Every byte that is not JSON goes through
``torch.load(weights_only=True)`` (whose unpickler accepts tensors and plain containers only);
DCP's ``.metadata``, a pickle that DCP itself would read with ``pickle.load``, is never read
(phalanx reads the same facts from JSON, :mod:`~phalanx.checkpoint.distributed`), so loading a
checkpoint never runs code from the file.

Writing is atomic. The chief writes every file into a hidden temporary directory, fsyncs each,
writes the manifest, then its digest file (temp file, fsync, ``os.replace`` each), then renames
the directory into place and fsyncs the parent. A crash at any point leaves either no new
checkpoint or a complete one; only directories with a manifest are checkpoints. DCP's files are
written by every replica into the same temporary directory (:func:`make_staging`) before the
chief writes the manifest, and recorded in it like the chief's own files.

Reading verifies every byte. The manifest holds the non-tensor state (counters, optimizer
hyperparameters, user values), so it is checked against ``MANIFEST.sha256`` whenever it is read
(:func:`read_manifest`: listing, choosing and restoring), and the digest file itself must be
exactly what phalanx writes; a damaged one raises :class:`CorruptCheckpointError` naming the file
and the reason. Choosing a checkpoint (:func:`choose_latest`, behind ``latest_checkpoint`` and
``CheckpointManager.restore_or_initialize``) also checks every tensor file against the manifest,
size and SHA-256, newest checkpoint first, and skips a damaged checkpoint with a warning that
names it and why (a flipped bit of the same size, a truncated or a missing file, an unparsable or
altered manifest), so a job that restarts after its storage damaged the latest save resumes from
the previous one instead of crash-looping or resuming with wrong state. A checkpoint written by
an earlier phalanx (no digest file, and a manifest that does not ask for one) still restores;
its manifest cannot be verified, which is said once per directory and process.
The cost stays at one hash per file: the writer hashes the bytes it writes (never reading them
back), and a file verified when chosen is not hashed again by the restore that follows, as long
as its size, times and inode are unchanged (:class:`VerifiedFiles`).

Fault injection for tests: ``PHALANX_CHECKPOINT_FAULT=after_file:K`` ends the process with
:data:`FAULT_EXIT_CODE` right after the K-th file of a save is written, ``before_commit`` after
the manifest is written but before the directory is renamed into place.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import time
import uuid
from typing import Any, Iterable, Iterator, NamedTuple

import torch

from phalanx.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from phalanx.config import settings
from phalanx.errors import DiskFullError

MANIFEST = "MANIFEST.json"
DIGEST = "MANIFEST.sha256"  # the manifest's digest, written after it (the manifest cannot hold its own)
FORMAT = "phalanx.checkpoint"
VERSION = 1
VERSION_SHARDED = 2  # a checkpoint with DCP files: an earlier phalanx refuses it by its version
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


def _disk_full(path: str, directory: str, error: OSError) -> DiskFullError:
    """The error for a save that ran out of space: a bare ``[Errno 28]`` names no checkpoint."""
    try:
        free: int | None = shutil.disk_usage(directory).free
    except OSError:
        free = None
    return DiskFullError(path, directory, free=free, error=error)


def _fault_point(name: str, index: int = 0) -> None:
    fault = settings().checkpoint_fault  # PHALANX_CHECKPOINT_FAULT
    if fault and (fault == name or fault == f"{name}:{index}"):
        os._exit(FAULT_EXIT_CODE)


def serialize_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def make_staging(path: str) -> str:
    """Makes the hidden temporary directory that becomes the checkpoint ``path`` when committed.

    For files that other processes write before the chief commits (DCP's shards); pass it to
    :func:`write_checkpoint` as ``staging``.
    """
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    return tmp


def file_record(file: str) -> dict[str, Any]:
    """The manifest's record of a file already on disk: its size and SHA-256 (read in chunks)."""
    size = os.path.getsize(file)
    return {"bytes": size, "sha256": _digest(_file_chunks(file))}


def write_checkpoint(
    path: str,
    files: dict[str, dict[str, torch.Tensor]],
    manifest: dict[str, Any],
    *,
    staging: str | None = None,
    staged: dict[str, dict[str, Any]] | None = None,
) -> str:
    """Writes a checkpoint directory at ``path`` atomically; returns ``path``.

    Args:
        files: file name -> the tensors it holds.
        manifest: the manifest's content; ``files``, ``format``, ``version`` and ``sequence`` are added.
        staging: a directory from :func:`make_staging` that already holds files written by others
            (it is committed, or removed on failure); None: a new one.
        staged: relative name -> :func:`file_record` of each file already in ``staging``.
    """
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    tmp = make_staging(path) if staging is None else staging
    try:
        records = dict(staged or {})
        for i, (name, tensors) in enumerate(files.items(), start=1):
            data = serialize_tensors(tensors)
            write_durable(os.path.join(tmp, name), data)
            records[name] = {"bytes": len(data), "sha256": _digest([data])}  # hashed while writing
            _fault_point("after_file", i)
        previous = [entry.sequence for entry in scan(parent) if entry.sequence is not None]
        full = {
            "format": FORMAT,
            "version": VERSION_SHARDED if staged else VERSION,
            "sequence": max(previous, default=0) + 1,
            "created_ns": time.time_ns(),
            "manifest_digest": DIGEST,  # says the digest file belongs: one missing later is damage
            **manifest,
            "files": records,
        }
        data = json.dumps(full, indent=1).encode()
        write_durable(os.path.join(tmp, MANIFEST), data)
        write_durable(os.path.join(tmp, DIGEST), _digest_record(data, full["sequence"]))
        for sub in {os.path.dirname(name) for name in records if os.path.dirname(name)}:
            _fsync_dir(os.path.join(tmp, sub))  # the staged files' directory entries
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(path, parent, e) from e
        raise
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return path


def delete_checkpoint(path: str) -> None:
    """Deletes a checkpoint; the manifest goes first, so a crash midway leaves no valid half."""
    for name in (MANIFEST, DIGEST):
        try:
            os.remove(os.path.join(path, name))
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


# --------------------------------------------------------------------------- the manifest's digest
_DIGEST_KEYS = ("manifest", "bytes", "sha256", "sequence")


def _digest_record(manifest: bytes, sequence: Any) -> bytes:
    """The content of the digest file for the manifest bytes ``manifest`` (one canonical JSON line).

    The sequence number is repeated so that a checkpoint whose manifest is damaged still sorts
    in its place among the others (and is reported when it is newer than the one chosen).
    """
    record = dict(zip(_DIGEST_KEYS, (MANIFEST, len(manifest), hashlib.sha256(manifest).hexdigest(), sequence)))
    return (json.dumps(record) + "\n").encode()


def seal_manifest(path: str) -> None:
    """Rewrites the digest file of the checkpoint at ``path`` for its manifest as it is now.

    For tools (and tests) that edit a manifest on purpose; a damaged manifest must never be
    sealed, since this makes whatever it holds the truth.
    """
    with open(os.path.join(path, MANIFEST), "rb") as f:
        data = f.read()
    write_durable(os.path.join(path, DIGEST), _digest_record(data, json.loads(data).get("sequence")))


def _read_digest(path: str) -> dict[str, Any] | None:
    """The digest record of the checkpoint at ``path``, None if it has no digest file.

    Raises:
        CorruptCheckpointError: the digest file is not byte for byte a record phalanx writes.
    """
    file = os.path.join(path, DIGEST)
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptCheckpointError(file, f"it cannot be read ({e}), so {MANIFEST} cannot be verified") from e
    try:
        record = json.loads(raw)
        valid = (
            isinstance(record, dict)
            and tuple(record) == _DIGEST_KEYS
            and record["manifest"] == MANIFEST
            and raw == (json.dumps(record) + "\n").encode()  # canonical: every byte of it is checked
        )
    except (ValueError, TypeError):
        valid = False
    if not valid:
        raise CorruptCheckpointError(
            file, f"it is not the digest record phalanx writes (its bytes changed), so {MANIFEST} cannot be verified"
        )
    return record


def _warn_unverified(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    key = (directory, "unverified")
    if key in _warned:
        return
    _warned.add(key)
    log.warning(
        "phalanx.checkpoint: the checkpoints in %r were written by an earlier phalanx version: their %s has no "
        "digest (%s), so their non-tensor state (counters, hyperparameters, values) is not verified; their "
        "tensor files are. Checkpoints saved from now on are verified whole.",
        directory,
        MANIFEST,
        DIGEST,
    )


# --------------------------------------------------------------------------- reading
def read_manifest(path: str) -> dict[str, Any]:
    """The verified manifest of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: ``path`` holds no checkpoint (no manifest, or not phalanx's).
        CorruptCheckpointError: the manifest or its digest file is damaged (names which, and why).
    """
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointNotFoundError(path) from e
    record = _read_digest(path)
    if record is not None and (record["bytes"] != len(data) or record["sha256"] != hashlib.sha256(data).hexdigest()):
        raise CorruptCheckpointError(
            file,
            f"its size or SHA-256 differs from what {DIGEST} records (one of the two changed after it was "
            "written: a flipped bit, a partial overwrite)",
        )
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise CorruptCheckpointError(file, f"it is not valid JSON ({str(e)[:120]})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointNotFoundError(path, hint="this directory was not written by phalanx.checkpoint")
    if record is None:
        if "manifest_digest" in manifest:
            raise CorruptCheckpointError(
                os.path.join(path, DIGEST), f"it is missing, but {MANIFEST} was written with it, so cannot be verified"
            )
        _warn_unverified(path)
    elif record["sequence"] != manifest.get("sequence"):
        raise CorruptCheckpointError(
            os.path.join(path, DIGEST), f"its sequence number differs from the one in {MANIFEST}"
        )
    if manifest.get("version") not in (VERSION, VERSION_SHARDED):
        raise CheckpointNotFoundError(
            path,
            hint=f"format version {manifest.get('version')!r} is not {VERSION} or {VERSION_SHARDED}; "
            "use the phalanx version that wrote it",
        )
    return manifest


def find_problem(path: str, manifest: dict[str, Any] | None = None) -> str | None:
    """Why the checkpoint at ``path`` cannot be restored, or None when every file is intact.

    Checks the manifest against its digest file (unless ``manifest`` is given, already read
    with :func:`read_manifest`), then each file the manifest records: present, of the recorded
    size, of the recorded SHA-256 (skipped for a file this process verified or wrote and nobody
    touched since).
    """
    try:
        manifest = read_manifest(path) if manifest is None else manifest
        records = dict(manifest["files"])
    except CorruptCheckpointError as e:
        return f"{os.path.basename(e.path)} is damaged: {e.problem}"
    except CheckpointNotFoundError:
        return f"its {MANIFEST} is missing or unreadable"
    except (KeyError, TypeError, ValueError):
        return f"its {MANIFEST} records no valid file list"
    for name, record in records.items():
        problem = _file_problem(path, name, record)
        if problem is not None:
            return f"{name} {problem}"
    return None


def _file_problem(path: str, name: str, record: Any) -> str | None:
    """Why the file ``name`` of the checkpoint at ``path`` differs from its ``record``, or None."""
    file = os.path.join(path, name)
    try:
        size = os.path.getsize(file)
    except OSError:
        return "is missing"
    expected = record.get("bytes") if isinstance(record, dict) else None
    if size != expected:
        what = "truncated" if isinstance(expected, int) and size < expected else "of the wrong size"
        return f"is {what}: {size} bytes, the manifest records {expected}"
    if _verified.matches(file, record.get("sha256")):
        return None
    try:
        actual = _digest(_file_chunks(file))
    except OSError as e:
        return f"cannot be read ({e})"
    if actual != record.get("sha256"):
        return (
            "has the right size but its SHA-256 differs from the manifest's (its bytes changed "
            "after it was written: a flipped bit, a partial overwrite)"
        )
    _verified.remember(file, actual)
    return None


def verify_file(path: str, name: str, record: Any) -> None:
    """Checks the file ``name`` of the checkpoint at ``path`` against its manifest ``record``
    (size, then SHA-256 read in chunks, once per process while the file is unchanged).

    Raises:
        CorruptCheckpointError: the file is missing, or its size or SHA-256 differs; names it.
    """
    problem = _file_problem(path, name, record)
    if problem is not None:
        raise CorruptCheckpointError(os.path.join(path, name), problem.removeprefix("is "))


def read_verified(path: str, name: str, record: Any) -> bytes:
    """The bytes of the file ``name`` of the checkpoint at ``path``, checked against ``record``.

    The bytes checked are the bytes returned (read once): what is parsed is what was verified.

    Raises:
        CorruptCheckpointError: the file is missing, or its size or SHA-256 differs; names it.
    """
    file = os.path.join(path, name)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CorruptCheckpointError(file, f"cannot be read ({e})") from e
    expected = record.get("bytes") if isinstance(record, dict) else None
    if len(data) != expected:
        raise CorruptCheckpointError(file, f"{len(data)} bytes, the manifest says {expected}")
    # A file verified when it was chosen a moment ago is not hashed twice.
    if not _verified.matches(file, record.get("sha256")) and _digest([data]) != record.get("sha256"):
        raise CorruptCheckpointError(file, "its SHA-256 differs from the manifest's")
    return data


def is_complete(path: str) -> bool:
    """Whether ``path`` holds a checkpoint whose manifest and files are all present (sizes only)."""
    try:
        manifest = read_manifest(path)
        return all(os.path.getsize(os.path.join(path, name)) == rec["bytes"] for name, rec in manifest["files"].items())
    except (CheckpointError, OSError, KeyError, TypeError):
        return False


class Entry(NamedTuple):
    """A checkpoint directory found by :func:`scan`.

    Attributes:
        path: its absolute path.
        manifest: its verified manifest, None when ``problem`` says it is damaged.
        problem: why its manifest cannot be trusted (names the file), or None.
        sequence: its place among the others; for a damaged one, the highest of the numbers its
            manifest and digest file still show (a bit flipped in one of them must not make it
            look older than it is), None when neither shows one (then it sorts as the newest).
    """

    path: str
    manifest: dict[str, Any] | None
    problem: str | None
    sequence: int | None


def _damaged_sequence(path: str) -> int | None:
    found = []
    for name in (MANIFEST, DIGEST):
        try:
            with open(os.path.join(path, name), "rb") as f:
                value = json.loads(f.read()).get("sequence")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            found.append(value)
    return max(found, default=None)


def scan(directory: str) -> list[Entry]:
    """Every checkpoint directly under ``directory``, damaged manifests included, oldest first.

    A directory is a checkpoint when it holds a manifest; one whose manifest or digest file is
    damaged is listed with the reason (so that choosing the latest one reports it instead of
    passing over it in silence). Tensor files are not checked here (:func:`choose_latest` does
    that, for the ones it considers).
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
            manifest = read_manifest(path)
        except CorruptCheckpointError as e:
            problem = f"{os.path.basename(e.path)} is damaged: {e.problem}"
            found.append(Entry(path, None, problem, _damaged_sequence(path)))
            continue
        except CheckpointNotFoundError:
            continue  # not a checkpoint (or a save that crashed before its manifest)
        sequence = manifest.get("sequence", 0)
        found.append(Entry(path, manifest, None, sequence if isinstance(sequence, int) else 0))

    def order(entry: Entry) -> tuple:
        created = entry.manifest.get("created_ns", 0) if entry.manifest is not None else 0
        sequence = float("inf") if entry.sequence is None else entry.sequence
        return (sequence, created if isinstance(created, int) else 0, entry.path)

    return sorted(found, key=order)


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
    data = read_verified(path, name, record)
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
