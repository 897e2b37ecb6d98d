"""DTensor state in a checkpoint: every replica writes its own shards with torch.distributed.checkpoint.

A model sharded by FullyShardedStrategy may not fit one process, so its state is never gathered:
the tensors of a checkpoint's objects that are DTensors are written by one collective
``torch.distributed.checkpoint.save`` (DCP) into ``sharded/`` of the checkpoint, each replica
writing the rows it owns to a file of its own (``sharded/__<rank>_0.distcp``), the chief DCP's
``.metadata``. Everything else (non-tensor state in the manifest, whole tensors in the objects'
``.pt`` files) is written as for any checkpoint, by the chief.

**Integrity.** Each replica hashes the files it wrote; the digests come to the chief over the
strategy's communicator (JSON, :meth:`Participants.exchange`) once DCP's save returned everywhere,
so every replica's files are on disk before the chief writes the manifest that records them, and
then commits the directory by renaming it, as for any checkpoint (:mod:`~phalanx.checkpoint.storage`):
a crash leaves no checkpoint or a complete one. A file that changed or went missing raises
:class:`CorruptCheckpointError` naming it, before anything is read from it.

**Safety.** DCP reads its ``.metadata`` with ``pickle.load`` and non-tensor values with
``torch.load(weights_only=False)`` (torch 2.13, ``filesystem.py``, ``default_planner.py``):
loading a DCP checkpoint with DCP's reader can run code from the file. The digests do not prevent
that: they detect damage, but whoever can write a checkpoint can rewrite its manifest too. So
phalanx never unpickles ``.metadata`` (it is kept, and verified, for torch's own tools): the chief
also writes the same facts as JSON (``sharded/index.json``: each tensor's dtype, shape, chunks and
where their bytes are), from which the reader builds DCP's metadata objects after checking every
value; only tensors are written, read back with ``torch.load(weights_only=True)`` as DCP does for
tensors, and a non-tensor entry would be refused without being read.

**Restoring.** :func:`load_into` reads the stored tensors into given tensors, locally (DCP
without a process group: restoring stays local, as for any checkpoint): into DTensors laid out as
the live shards (:func:`empty_shard`), where DCP reads just this replica's rows from the saved
shards, any replica count; or into whole tensors (:func:`materialize`), for Mirrored, one device,
or plain PyTorch (:func:`~phalanx.checkpoint.load_state`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from typing import Any

import torch

from phalanx.checkpoint import storage
from phalanx.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

SUBDIR = "sharded"
METADATA = ".metadata"  # DCP's name for its pickle, which phalanx never reads
INDEX = "index.json"  # the same facts, as JSON: what phalanx reads
_DATA_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp\Z")  # DCP's data files: __<rank>_<n>.distcp


def is_distributed(value: Any) -> bool:
    """Whether ``value`` is a DTensor (without importing torch.distributed.tensor when no one did)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False  # no DTensor can exist before the module is imported
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    """What the manifest records of a stored DTensor: its global shape and dtype."""
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


# --------------------------------------------------------------------------- saving
def write_shards(
    who: Any, tensors: dict[str, torch.Tensor], path: str
) -> tuple[str | None, dict, BaseException | None]:
    """Every replica writes its shards of ``tensors`` (DTensors) into the checkpoint at ``path``'s staging
    directory (a collective: every process calls it with the same keys).

    Process 0 makes the staging directory (:func:`storage.make_staging`) and tells the others;
    DCP writes into its ``sharded/``, process 0 adds ``index.json``; then every process hashes the
    files it wrote and the digests come to every process.

    Args:
        who: the :class:`~phalanx.checkpoint.coordination.Participants` of the save.
        tensors: DCP key -> DTensor.
        path: the checkpoint's path on process 0.

    Returns:
        ``(staging, records, error)``: on process 0, the staging directory (to commit, or remove)
        and the manifest's records of the files in it (``"sharded/<name>" -> {bytes, sha256}``);
        elsewhere ``(None, {}, error)``. ``error``: why this process's part failed, or None.
    """
    error: BaseException | None = None
    staging = None
    if who.rank == 0:
        try:
            staging = storage.make_staging(path)
        except Exception as e:  # noqa: BLE001 - reported to every process by the caller
            error = e
    shared = who.exchange(staging)[0]
    if shared is None:  # process 0 could not make it: nothing written anywhere
        return None, {}, error or CheckpointError("Process 0 could not create the checkpoint's directory.")
    directory = os.path.join(shared, SUBDIR)
    mine: dict[str, Any] | None = None
    try:
        rank, metadata = _save(tensors, directory, who.world_size)
        if who.rank == 0:  # DCP's metadata as phalanx reads it (never the pickle)
            storage.write_durable(os.path.join(directory, INDEX), json.dumps(_index_of(metadata)).encode())
        # Each replica hashes its own files (from its page cache), not the chief all of them.
        mine = {
            name: storage.file_record(os.path.join(directory, name))
            for name in sorted(os.listdir(directory))
            if _DATA_FILE.match(name) and name.startswith(f"__{rank}_")
        }
    except Exception as e:  # noqa: BLE001 - reported to every process by the caller
        error = e
    everyone = who.exchange(mine)  # after DCP's save returned everywhere: every file is on disk
    if who.rank != 0:
        return None, {}, error
    records: dict[str, Any] = {}
    try:
        if error is None:
            failed = [k for k, part in enumerate(everyone) if part is None]
            if failed:
                raise CheckpointError(f"Replicas {failed} failed to write their shards into {directory!r}.")
            for part in everyone:
                records.update(part)
            present = set(os.listdir(directory))
            absent = sorted(set(records) - present)
            if absent:
                raise CheckpointError(
                    f"Files other replicas wrote into {directory!r} are not there for the chief: {absent}.",
                    hint="a checkpoint directory must be on storage that every replica sees (a shared filesystem)",
                )
            for name in sorted(present - set(records)):  # DCP's .metadata, and anything unclaimed
                records[name] = storage.file_record(os.path.join(directory, name))
    except Exception as e:  # noqa: BLE001 - reported to every process by the caller
        error = e
    return staging, {f"{SUBDIR}/{name}": record for name, record in records.items()}, error


def _save(tensors: dict[str, torch.Tensor], directory: str, world_size: int) -> tuple[int, Any]:
    """DCP's collective save of ``tensors`` into ``directory``; returns this process's rank in it
    and DCP's metadata of the whole save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    # DTensors live on torch's default process group (FullyShardedStrategy makes it): DCP plans
    # the save over it, and it must be this checkpoint's processes.
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        raise CheckpointError(
            f"DTensor state is saved over torch's default process group, which spans "
            f"{dist.get_world_size() if dist.is_initialized() else 'no'} processes, not this job's {world_size}.",
            hint="save DTensor state (FullyShardedStrategy) under the strategy that made it",
        )
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=1)
    metadata = dcp.save(dict(tensors), storage_writer=writer)
    return dist.get_rank(), metadata


# --------------------------------------------------------------------------- the index: DCP's metadata as JSON
def _index_of(metadata: Any) -> dict[str, Any]:
    """What phalanx keeps of DCP's metadata (the pickle ``.metadata``), as JSON: each tensor's
    dtype, shape and chunks, and where each chunk's bytes are."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    tensors: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):  # never: phalanx saves tensors only
            raise CheckpointError(f"DCP stored {key!r} as {type(entry).__name__}, not as a tensor.")
        chunks = []
        for chunk in entry.chunks:
            where = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
            chunks.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "file": where.relative_path,
                    "offset": where.offset,
                    "length": where.length,
                }
            )
        tensors[key] = {
            "dtype": str(entry.properties.dtype).removeprefix("torch."),
            "size": list(entry.size),
            "chunks": chunks,
        }
    return {"format": "phalanx.dcp-index", "version": getattr(metadata, "version", None), "tensors": tensors}


def read_metadata(path: str, manifest: dict[str, Any] | None = None) -> Any:
    """DCP's metadata of the checkpoint at ``path``, rebuilt from phalanx's JSON index (verified).

    DCP's own ``.metadata`` is a pickle, which DCP reads with ``pickle.load``: it could run code.
    phalanx never reads it (it is kept, and verified, for torch's own tools); the same facts come
    from ``index.json``, whose every value is checked before a DCP object is built from it.

    Args:
        path: the checkpoint directory.
        manifest: its manifest, already read with :func:`storage.read_manifest`.

    Raises:
        CorruptCheckpointError: ``index.json`` or ``.metadata`` is missing or changed since it was
            written, or the index is malformed.
        UnsafeCheckpointError: the index points at a file the manifest does not record.
    """
    manifest = storage.read_manifest(path) if manifest is None else manifest
    records = manifest.get("files", {})
    for name in (METADATA, INDEX):
        if f"{SUBDIR}/{name}" not in records:
            raise CorruptCheckpointError(
                os.path.join(path, SUBDIR, name), "the manifest records no such file, but names sharded tensors"
            )
    storage.verify_file(path, f"{SUBDIR}/{METADATA}", records[f"{SUBDIR}/{METADATA}"])
    file = os.path.join(path, SUBDIR, INDEX)
    data = storage.read_verified(path, f"{SUBDIR}/{INDEX}", records[f"{SUBDIR}/{INDEX}"])
    try:
        return _metadata_from(json.loads(data), records)
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(file, str(e.args[0])[:200]) from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CorruptCheckpointError(file, f"it is not a valid index ({type(e).__name__}: {str(e)[:120]})") from e


def _metadata_from(index: Any, records: dict[str, Any]) -> Any:
    """DCP's ``Metadata`` built from ``index`` (:func:`_index_of`'s), every value checked first."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def ints(values: Any) -> torch.Size:
        if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
            raise ValueError(f"{values!r:.80} is not a list of non-negative integers")
        return torch.Size(values)

    if not isinstance(index, dict) or index.get("format") != "phalanx.dcp-index":
        raise ValueError("no phalanx.dcp-index")
    state, where = {}, {}
    for key, entry in index["tensors"].items():
        dtype = getattr(torch, str(entry["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {entry['dtype']!r:.40}")
        chunks = []
        for chunk in entry["chunks"]:
            offsets, sizes = ints(chunk["offsets"]), ints(chunk["sizes"])
            name = chunk["file"]
            if not isinstance(name, str) or not _DATA_FILE.match(name) or f"{SUBDIR}/{name}" not in records:
                raise UnsafeCheckpointError("", f"it points at {name!r:.80}, a file the manifest does not record")
            offset, length = ints([chunk["offset"], chunk["length"]])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            where[MetadataIndex(key, offsets, len(chunks) - 1)] = filesystem._StorageInfo(  # friend: DCP's record
                relative_path=name, offset=offset, length=length
            )
        properties = TensorProperties(dtype=dtype)
        state[key] = TensorStorageMetadata(properties=properties, size=ints(entry["size"]), chunks=chunks)
    metadata = Metadata(
        state_dict_metadata=state,
        planner_data={key: (key,) for key in state},  # DCP's flattening of flat keys
        storage_data=where,
    )
    version = index.get("version")
    if isinstance(version, str) and hasattr(metadata, "version"):  # a field since torch 2.5 or so
        metadata.version = version
    return metadata


class Source:
    """The DCP files of one checkpoint, verified as they are first read."""

    def __init__(self, path: str, manifest: dict[str, Any]) -> None:
        self.path = path
        self._manifest = manifest
        self._metadata: Any = None

    @property
    def metadata(self) -> Any:
        if self._metadata is None:
            self._metadata = read_metadata(self.path, self._manifest)
        return self._metadata

    def verify(self, relative: str) -> None:
        """Checks one data file (``relative`` to ``sharded/``) against the manifest before DCP reads it."""
        name = f"{SUBDIR}/{relative}"
        storage.verify_file(self.path, name, self._manifest["files"].get(name))

    def stored(self, name: str, key: str, ref: Any) -> "Stored":
        """The placeholder for tensor ``key`` of object ``name`` as the manifest records it (``ref``)."""
        try:
            dtype = getattr(torch, str(ref["dtype"]))
            shape = tuple(int(n) for n in ref["shape"])
            stored_as = str(ref["key"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointMismatchError(name, f"the manifest's record of sharded tensor {key!r} is malformed") from e
        if not isinstance(dtype, torch.dtype):
            raise CheckpointMismatchError(name, f"unknown dtype {ref['dtype']!r} of sharded tensor {key!r}")
        if not any(f.startswith(f"{SUBDIR}/") for f in self._manifest.get("files", {})):
            raise CheckpointMismatchError(
                name,
                f"its tensor {key!r} was written sharded, but this checkpoint holds no shards (a copy "
                "written by a worker other than the chief holds the chief's objects only)",
                hint="restore the chief's checkpoint",
            )
        return Stored(self, stored_as, shape, dtype)


class Stored:
    """A tensor of a checkpoint written sharded, not read yet: :func:`load_into` reads it into a
    tensor laid out as the caller wants (a replica's shard, or the whole tensor).

    Attributes:
        key: its DCP key (``"<object>/<state path>"``).
        shape, dtype: the whole tensor's.
    """

    def __init__(self, source: Source, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.source, self.key, self.shape, self.dtype = source, key, torch.Size(shape), dtype

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Stored({self.key!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


# --------------------------------------------------------------------------- restoring
def empty_shard(stored: Stored, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised DTensor of ``stored``'s shape, laid out (mesh, placements, device, dtype) as ``like``."""
    from torch.distributed.tensor import empty

    return empty(stored.shape, dtype=like.dtype, device_mesh=like.device_mesh, placements=like.placements)


def load_into(targets: list[tuple[Stored, torch.Tensor]]) -> None:
    """Reads each stored tensor into its target (a DTensor: only its local rows are read), locally.

    Raises:
        CorruptCheckpointError: a file read changed or is missing (checked before it is read).
        UnsafeCheckpointError: the metadata is not plain DCP metadata.
        CheckpointMismatchError: a key or shape does not fit.
    """
    by_source: dict[int, tuple[Source, dict[str, torch.Tensor]]] = {}
    for stored, target in targets:
        source, state = by_source.setdefault(id(stored.source), (stored.source, {}))
        if tuple(target.shape) != tuple(stored.shape):
            raise CheckpointMismatchError(
                stored.key, f"shape {tuple(target.shape)} here, {tuple(stored.shape)} in the checkpoint"
            )
        state[stored.key] = target
    for source, state in by_source.values():
        metadata = source.metadata  # verified and checked before DCP sees anything
        for key, target in state.items():
            entry = metadata.state_dict_metadata.get(key)
            if entry is None or tuple(entry.size) != tuple(target.shape):
                raise CorruptCheckpointError(
                    os.path.join(source.path, SUBDIR, METADATA),
                    f"it does not hold {key!r} of shape {tuple(target.shape)}, which the manifest records",
                )
        _dcp_load(source, state)


def _dcp_load(source: Source, state: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            # "torch.distributed is disabled ... assuming the intent is to load in a single process": it is.
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=_reader(source), planner=_planner(), no_dist=True)
    except CheckpointException as e:
        for failure in getattr(e, "failures", {}).values():
            cause = failure[0] if isinstance(failure, tuple) else failure  # (exception, its traceback)
            if isinstance(cause, CheckpointError):
                raise cause from None
        raise CheckpointMismatchError(source.path, f"reading the sharded tensors failed: {str(e)[:300]}") from e


_CLASSES: dict[str, type] = {}


def _reader(source: Source) -> Any:
    """A DCP ``FileSystemReader`` of ``source`` whose metadata is :func:`read_metadata`'s (never
    DCP's ``pickle.load``), and that verifies each file before reading from it."""
    if "reader" not in _CLASSES:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import StorageMeta

        class Reader(FileSystemReader):
            def __init__(self, source: Source) -> None:
                super().__init__(os.path.join(source.path, SUBDIR))
                self._source = source

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                metadata = self._source.metadata
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = getattr(self, "load_id", None)
                return metadata

            def read_data(self, plan: Any, planner: Any) -> Any:
                for relative in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                    self._source.verify(relative)  # the files this replica reads, before it reads them
                return super().read_data(plan, planner)

        _CLASSES["reader"] = Reader
    return _CLASSES["reader"](source)


def _planner() -> Any:
    """DCP's default load planner, except that a non-tensor value is refused, not unpickled."""
    if "planner" not in _CLASSES:
        from torch.distributed.checkpoint import DefaultLoadPlanner

        class Planner(DefaultLoadPlanner):
            def load_bytes(self, read_item: Any, value: Any) -> None:
                # DCP would torch.load(weights_only=False) it; phalanx never writes one.
                raise UnsafeCheckpointError(read_item.dest_index.fqn, "a sharded checkpoint holds tensors only")

        _CLASSES["planner"] = Planner
    return _CLASSES["planner"]()


def materialize(tree: Any) -> Any:
    """``tree`` with every :class:`Stored` read into a whole CPU tensor (one read per checkpoint)."""
    found: list[Stored] = []

    def collect(value: Any) -> None:
        if isinstance(value, Stored):
            found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)

    collect(tree)
    if not found:
        return tree
    unique = list({id(s): s for s in found}.values())
    whole = {id(s): torch.empty(s.shape, dtype=s.dtype) for s in unique}
    load_into([(s, whole[id(s)]) for s in unique])

    def rebuild(value: Any) -> Any:
        if isinstance(value, Stored):
            return whole[id(value)]
        if isinstance(value, dict):
            return {k: rebuild(v) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(rebuild(v) for v in value)
        if isinstance(value, list):
            return [rebuild(v) for v in value]
        return value

    return rebuild(tree)
