"""Reads a W&B run file (``run-<id>.wandb``) back with W&B's own record types.

W&B writes an offline run as a LevelDB-style log of ``wandb_internal.Record`` protocol buffers
(wandb's ``internal/datastore``; 0.31 ships no Python reader, only the Go one): a 7-byte header
(``:W&B``, a magic number and a version), then 32 KiB blocks of chunks, each ``crc32c (4) | length
(2, little endian) | type (1: whole, 2: first, 3: middle, 4: last) | data``. The records are parsed
with ``wandb.proto.wandb_internal_pb2.Record``, the class the client wrote them with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_HEADER = 7
_BLOCK = 32 * 1024
_CHUNK_HEADER = 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pos, pending = [], _HEADER, b""
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 0:  # preallocated, never written
            break
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """The rows ``run.log`` wrote, each a dict of the logged keys (``_step`` and the like included)."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def config(path: Path) -> dict[str, Any]:
    """The run's config: the run record's, updated by every config record after it."""
    found: dict[str, Any] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        update = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in update:
            found[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return found


def run_record(path: Path) -> Any:
    """The run record (its id, display name, project)."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
