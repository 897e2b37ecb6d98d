"""The messages of parameter-server training: a JSON header, raw tensors, raw blobs, signed.

A frame is ``MAGIC | MAC | u32 header length | u32 blobs length | header JSON | blobs | tensors``.
The header lists the parts: tensors (dtype name and shape; their bytes follow, in native byte
order) and blobs (bytes, e.g. a pickled function shipped from the coordinator to a worker). The MAC
is HMAC-SHA256 with the cluster secret over the method name, the direction (call or reply), the
header and the blobs, and it is checked (``hmac.compare_digest``) before anything in the frame is
parsed. So a request is only acted on when its sender holds the secret, and code (a blob) is only
unpickled, by workers, when it was signed with it (:mod:`phalanx.ps.pickling`). Tensors are never
pickled; their *layout* is in the signed header, their bytes are not signed: hashing every
gradient and parameter would cost more than the transfer itself (SHA-256 runs at ~0.9 GB/s
here), and without TLS an on-path attacker could replay signed frames anyway. Run clusters on a
trusted network, as TensorFlow and PyTorch require.

Example:
    >>> import torch
    >>> frame = encode("read", {"keys": ["v0"]}, [torch.arange(3.)], secret=b"s" * 16)
    >>> msg = decode("read", frame, secret=b"s" * 16)
    >>> msg.header["keys"], msg.tensors[0].tolist()
    (['v0'], [0.0, 1.0, 2.0])
    >>> decode("read", frame, secret=b"x" * 16)
    Traceback (most recent call last):
    ...
    phalanx.ps.errors.AuthenticationError: message refused: bad signature (wrong cluster secret, or not a phalanx frame)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.ps.errors import AuthenticationError, ClusterSecretError, ProtocolError

MAGIC = b"PHX1"
_MAC_BYTES = 32
_MAX_HEADER_BYTES = 16 << 20
SECRET_ENV = "PHALANX_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "complex64", "complex128")
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``; raises ProtocolError for dtypes the wire does not carry."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot be sent to a parameter server",
                            hint=f"use one of {sorted(_DTYPES)}") from None


def dtype_from_name(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise ProtocolError(f"unknown dtype {name!r} in a message")
    return _DTYPES[name]


def cluster_secret(explicit: str | bytes | None = None, environ: Mapping[str, str] | None = None) -> bytes:
    """The cluster's shared secret: ``explicit``, else ``PHALANX_CLUSTER_SECRET``.

    Raises:
        ClusterSecretError: none is set, or it is shorter than 16 characters.
    """
    value = explicit if explicit is not None else (os.environ if environ is None else environ).get(SECRET_ENV)
    if value is None or (isinstance(value, (str, bytes)) and not value.strip()):
        raise ClusterSecretError("<unset>", "parameter-server training ships code between tasks and needs a "
                                            "shared secret to authenticate it")
    raw = value.encode() if isinstance(value, str) else bytes(value)
    if len(raw) < MIN_SECRET_CHARS:
        raise ClusterSecretError(f"<{len(raw)} characters>", f"must be at least {MIN_SECRET_CHARS} characters")
    return raw


def generate_secret() -> str:
    """A fresh random secret (64 hex characters)."""
    return secrets.token_hex(32)


@dataclass
class Message:
    """A decoded frame."""

    header: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)


def _mac(secret: bytes, method: str, reply: bool, signed: Any) -> bytes:
    mac = hmac.new(secret, (b"reply:" if reply else b"call:") + method.encode() + b"\0", hashlib.sha256)
    mac.update(signed)
    return mac.digest()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


_LENGTHS = struct.Struct("<II")
_PREFIX = len(MAGIC) + _MAC_BYTES


def encode(method: str, header: Mapping[str, Any] | None = None, tensors: Sequence[torch.Tensor] = (),
           blobs: Sequence[bytes] = (), *, secret: bytes, reply: bool = False) -> bytes:
    """Builds a signed frame for ``method`` (a call, or with ``reply=True`` its answer)."""
    parts: list[list[Any]] = [["t", dtype_name(t.dtype), list(t.shape)] for t in tensors]
    parts += [["b", len(b)] for b in blobs]
    head = json.dumps({**(header or {}), "parts": parts}, separators=(",", ":")).encode()
    signed = b"".join([_LENGTHS.pack(len(head), sum(len(b) for b in blobs)), head, *blobs])
    return b"".join([MAGIC, _mac(secret, method, reply, signed), signed, *(_tensor_bytes(t) for t in tensors)])


def verify(method: str, frame: bytes, *, secret: bytes, reply: bool = False) -> tuple[memoryview, int]:
    """Checks the frame's signature; returns its body and the length of the signed part.

    Only the two lengths are read before the check; nothing else is parsed before it succeeds.
    """
    refused = AuthenticationError("message refused: bad signature (wrong cluster secret, or not a phalanx frame)")
    view = memoryview(frame)
    if len(view) < _PREFIX + _LENGTHS.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise refused
    body = view[_PREFIX:]
    head_len, blobs_len = _LENGTHS.unpack_from(body, 0)
    signed_len = _LENGTHS.size + head_len + blobs_len
    if head_len > _MAX_HEADER_BYTES or signed_len > len(body):
        raise refused
    if not hmac.compare_digest(bytes(view[len(MAGIC):_PREFIX]), _mac(secret, method, reply, body[:signed_len])):
        raise refused
    return body, signed_len


def decode(method: str, frame: bytes, *, secret: bytes, reply: bool = False) -> Message:
    """Verifies and parses a frame.

    Raises:
        AuthenticationError: the signature is wrong (nothing was parsed).
        ProtocolError: the signed frame is malformed.
    """
    body, signed_len = verify(method, frame, secret=secret, reply=reply)
    head_len, _ = _LENGTHS.unpack_from(body, 0)
    try:
        header = json.loads(bytes(body[_LENGTHS.size:_LENGTHS.size + head_len]))
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict) or not isinstance(header.get("parts"), list):
        raise ProtocolError("header must be an object with a 'parts' list")
    msg = Message(header)
    blob_at, tensor_at = _LENGTHS.size + head_len, signed_len
    for part in header.pop("parts"):
        if not isinstance(part, list) or not part:
            raise ProtocolError(f"malformed part {part!r}")
        if part[0] == "t" and len(part) == 3:
            dtype = dtype_from_name(part[1])
            shape = part[2]
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ProtocolError(f"malformed shape {shape!r}")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if tensor_at + nbytes > len(body):
                raise ProtocolError(f"tensor of shape {shape} overruns the message")
            if nbytes == 0:
                msg.tensors.append(torch.empty(shape, dtype=dtype))
            else:
                # bytearray: a writable copy that the tensor owns (frombuffer would share read-only bytes).
                raw = torch.frombuffer(bytearray(body[tensor_at:tensor_at + nbytes]), dtype=torch.uint8)
                msg.tensors.append(raw.view(dtype).reshape(shape))
            tensor_at += nbytes
        elif part[0] == "b" and len(part) == 2 and isinstance(part[1], int) and part[1] >= 0:
            if blob_at + part[1] > signed_len:
                raise ProtocolError("blob overruns the signed part of the message")
            msg.blobs.append(bytes(body[blob_at:blob_at + part[1]]))
            blob_at += part[1]
        else:
            raise ProtocolError(f"malformed part {part!r}")
    if blob_at != signed_len or tensor_at != len(body):
        raise ProtocolError("the parts do not add up to the message's length")
    return msg
