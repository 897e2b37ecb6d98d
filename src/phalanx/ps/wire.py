"""The messages of parameter-server training: signed frames of a JSON header, raw tensors and blobs.

A frame is a *head*, a *body* and a *tag*. The body is ``u32 header length | u32 blobs length |
header JSON | blobs | tensors`` (each tensor's bytes start at a multiple of 16 bytes, native byte
order; the header lists the parts: tensors by dtype and shape, blobs by length). The head says who
sent the frame and when; its MAC authenticates it, and the tag after the body authenticates every
byte of the body under a key that only this head gives:

=============  ============================================================================
magic          ``PHX3``
mac            HMAC-SHA256 (cluster secret) over the method and every field below
kind           call or reply
sender         16 random bytes, one per sending channel (:class:`Signer`)
seq            the sender's frame number: 1, 2, 3, ...
time           the sender's clock (Unix seconds) when it signed the frame
body length    bytes that follow the head (the tag follows them)
reply to       for a reply, the sender and seq of the call it answers
task           the sending task's name (``chief:0``), for logs and liveness
*body*
tag            AES-256-GMAC over every byte of the body (keyed BLAKE2b for a body of at most
               4 KiB), with a one-time key derived from the secret, the method and the head's
               fields (:class:`~phalanx.ps.frame_mac._BodyMac`)
=============  ============================================================================

Signing every byte costs one pass of AES-GMAC (AES-GCM with the body as associated data and no
plaintext; OpenSSL runs it on the CPU's AES and carry-less-multiply instructions at about 20 GB/s
here, against 11 GB/s for Poly1305 and 1.7 GB/s for HMAC-SHA256) over bytes that are in the CPU's
cache anyway, in as few calls as it can. A frame whose head and body fit in ``MAX_MESSAGE_BYTES``
(1 MiB and 1 KiB: a 1 MiB tensor with its header fits) travels as one message: the sender tags
its body in one call right after copying the tensors into it, the receiver in one call inside the
message as the transport delivered it, before copying it out. A larger frame travels in chunks of
``CHUNK_BYTES``: the sender tags each chunk right after copying it (one streaming GCM context per
frame), the receiver the whole body in one call once it is copied. Before it reads a byte, a
one-shot call costs 2 us in a warm process and 60 us after the caches were flushed; a streaming
context (its Python layer) 11 and 160 us, more than tagging a cached MiB, so frames of up to a
MiB do without it. The tag comes last: a tag in the head would need its own pass over the
tensors before the first message is sent, and a tensor that the training step left in main
memory is read from there at a few GB/s (on a busy 2-core VM such a pass over 1 MiB cost about
200 us, twice the tag over the copied message). A receiver checks the head first (a few hundred
bytes) and refuses a forged one before it reads, or allocates, the body; the tag is checked
before any of the body is parsed. So a request is only acted on when its sender holds the
secret, and code (a blob) is only unpickled, by workers, when it was signed with it
(:mod:`phalanx.ps.pickling`).

Replays. A server accepts each (sender, seq) once (:class:`ReplayGuard`): a frame whose number it
has seen is refused, and so is one more than ``REPLAY_WINDOW`` (1024) numbers older than the
newest from its sender (reordered beyond the window). A frame whose time differs from the server's
clock by more than ``PHALANX_CLOCK_SKEW`` seconds (default 60) is refused, which bounds what a
server that restarted, and so forgot the numbers it had seen, can be replayed. A reply is bound to
its call (sender and seq), so an old reply cannot stand in for a new one.

Frames travel in messages of at most ``MAX_MESSAGE_BYTES`` (one frame, or a chunk of
``CHUNK_BYTES`` of a larger one), so a transport can refuse any larger message before reading it
without capping the size of a model.

Example:
    >>> import torch
    >>> secret = b"s" * 16
    >>> frame = Signer(secret, "chief:0").encode("read", {"keys": ["v0"]}, [torch.arange(3.)])
    >>> msg = Verifier(secret, ReplayGuard()).decode("read", frame.chunks())
    >>> msg.header["keys"], msg.tensors[0].tolist(), msg.head.task
    (['v0'], [0.0, 1.0, 2.0], 'chief:0')
    >>> Verifier(b"x" * 16).decode("read", frame.chunks())
    Traceback (most recent call last):
    ...
    phalanx.ps.errors.AuthenticationError: message refused: bad signature (wrong cluster secret, or not a phalanx frame)
"""

from __future__ import annotations

import hmac
import itertools
import json
import math
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.ps.errors import AuthenticationError, ClusterSecretError, OverloadedError, ProtocolError
from phalanx.ps.frame_mac import _SMALL_BODY, _body_key, _BodyMac, _head_mac
from phalanx.ps.secret import MIN_SECRET_CHARS, SECRET_ENV, generate_secret  # noqa: F401 - re-exported

MAGIC = b"PHX3"  # PHX2 frames carried a Poly1305 body tag
CALL, REPLY = 0, 1
CHUNK_BYTES = 1 << 20
# The largest message a transport accepts: a frame whose head and body fit goes as one message
# (the head, a header and a tensor of CHUNK_BYTES fit), larger frames in chunks of CHUNK_BYTES.
MAX_MESSAGE_BYTES = CHUNK_BYTES + 1024
REPLAY_WINDOW = 1024
MAX_SENDERS = 4096
DEFAULT_CLOCK_SKEW = 60.0
CLOCK_SKEW_ENV = "PHALANX_CLOCK_SKEW"
_ALIGN = 16
_MAX_HEADER_BYTES = 64 << 20
_MAX_TASK_BYTES = 255
_MAX_DIM = 1 << 62  # a tensor dimension beyond any message (torch refuses sizes past int64)
# magic, mac, kind, sender, seq, time, body length, reply-to sender, reply-to seq, task length
_FIXED = struct.Struct("<4s32sB16sQdQ16sQB")
_TAG_BYTES = 16
_SIGNED_AT = 4 + 32  # the fields after the magic and the mac
_LENGTHS = struct.Struct("<II")
_NO_SENDER = bytes(16)

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
    )
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``; raises ProtocolError for dtypes the wire does not carry."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(
            f"dtype {dtype} cannot be sent to a parameter server", hint=f"use one of {sorted(_DTYPES)}"
        ) from None


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
        raise ClusterSecretError(
            "<unset>", "parameter-server training ships code between tasks and needs a shared secret to authenticate it"
        )
    raw = value.encode() if isinstance(value, str) else bytes(value)
    if len(raw) < MIN_SECRET_CHARS:
        raise ClusterSecretError(f"<{len(raw)} characters>", f"must be at least {MIN_SECRET_CHARS} characters")
    return raw


def clock_skew(environ: Mapping[str, str] | None = None) -> float:
    """``PHALANX_CLOCK_SKEW`` (seconds a frame's time may differ from the receiver's clock), default 60."""
    raw = (os.environ if environ is None else environ).get(CLOCK_SKEW_ENV, "").strip()
    if not raw:
        return DEFAULT_CLOCK_SKEW
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from phalanx.errors import PhalanxError

        raise PhalanxError(
            f"{CLOCK_SKEW_ENV}={raw!r} is not a positive number of seconds",
            hint="unset it for the default (60 s), or give the largest clock difference between "
            "the cluster's hosts plus the longest time a request waits in a queue",
        )
    return value


@dataclass(frozen=True)
class Head:
    """Who sent a frame, when, and which call a reply answers (see the module docstring)."""

    kind: int
    sender: bytes
    seq: int
    time: float
    body_len: int
    reply_sender: bytes = _NO_SENDER
    reply_seq: int = 0
    task: str = ""

    def fields(self) -> bytes:
        task = self.task.encode()
        return (
            _FIXED.pack(
                MAGIC,
                bytes(32),
                self.kind,
                self.sender,
                self.seq,
                self.time,
                self.body_len,
                self.reply_sender,
                self.reply_seq,
                len(task),
            )[_SIGNED_AT:]
            + task
        )


def _body_nonce(head: Head) -> bytes:
    return struct.pack("<Q", head.seq) + head.sender[:4]


@dataclass
class Message:
    """A decoded, verified frame."""

    header: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)
    head: Head | None = None


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def _pad(n: int) -> int:
    return -n % _ALIGN


class Frame:
    """A signed frame ready to send: its head and the buffers of its body (the tensors' own memory)."""

    def __init__(self, signer: Signer, method: str, parts: list[Any], body_len: int, reply_to: Head | None) -> None:
        self._signer, self.method, self._parts, self._reply_to = signer, method, parts, reply_to
        self.head = Head(
            REPLY if reply_to is not None else CALL,
            signer.sender,
            signer.next_seq(),
            time.time(),
            body_len,
            reply_to.sender if reply_to else _NO_SENDER,
            reply_to.seq if reply_to else 0,
            signer.task,
        )
        fields = self.head.fields()
        self._body_key = _body_key(signer.secret, method, fields)
        self._head_bytes = MAGIC + _head_mac(signer.secret, method, fields) + fields

    @property
    def nbytes(self) -> int:
        return len(self._head_bytes) + self.head.body_len + _TAG_BYTES

    def renewed(self) -> Frame:
        """The same content under a new number and time (to send again: a server takes each number once)."""
        return Frame(self._signer, self.method, self._parts, self.head.body_len, self._reply_to)

    def chunks(self, size: int | None = None) -> Iterator[bytes]:
        """The frame as ``bytes`` messages, copied from the buffers one message at a time.

        By default a frame whose head and body fit in ``MAX_MESSAGE_BYTES`` goes as one message
        (its tag appended, or after it in a message of its own if the body is large), larger
        frames in messages of ``CHUNK_BYTES``; ``size`` cuts every frame into messages of that
        size. Body bytes are tagged right after they are copied into a message, while they are
        in the CPU's cache (see the module docstring); the tag is sent last.
        """
        whole = len(self._head_bytes) + self.head.body_len
        if size is None and whole <= MAX_MESSAGE_BYTES:
            yield from self._one_message()
            return
        size = size or CHUNK_BYTES
        mac = _BodyMac(self._body_key, _body_nonce(self.head), self.head.body_len)
        body_at = len(self._head_bytes)
        body_end = body_at + self.head.body_len
        start = 0  # the frame offset of the chunk being filled
        pending: list[Any] = []
        room = size
        for part in [memoryview(self._head_bytes), *self._parts]:
            view = part if isinstance(part, memoryview) else memoryview(part)
            while len(view):
                take = view[:room]
                pending.append(take)
                view = view[len(take) :]
                room -= len(take)
                if room == 0:
                    chunk = b"".join(pending)
                    mac.update(memoryview(chunk)[max(0, body_at - start) : max(0, body_end - start)])
                    yield chunk
                    start += size
                    pending, room = [], size
        chunk = b"".join(pending)
        mac.update(memoryview(chunk)[max(0, body_at - start) : max(0, body_end - start)])
        tag = mac.finalize()
        if room >= _TAG_BYTES and len(chunk) <= _SMALL_BODY:
            yield chunk + tag  # one message, for the price of copying a small chunk again
        else:
            if chunk:
                yield chunk
            for at in range(0, _TAG_BYTES, size):
                yield tag[at : at + size]

    def _one_message(self) -> Iterator[bytes]:
        mac = _BodyMac(self._body_key, _body_nonce(self.head), self.head.body_len)
        if self.head.body_len <= _SMALL_BODY:
            # Hashed from the buffers (usually one), then copied once with the tag after them.
            if len(self._parts) == 1:
                tag = mac.of(self._parts[0])
            else:
                for part in self._parts:
                    mac.update(part)
                tag = mac.finalize()
            yield b"".join([self._head_bytes, *self._parts, tag])
            return
        # Tagged in one call (no streaming context to set up) right after the copy, while the
        # bytes are in the cache; the tag follows in a message of its own (appending it would
        # copy the whole message again).
        message = b"".join([self._head_bytes, *self._parts])
        yield message
        yield mac.of(memoryview(message)[len(self._head_bytes) :])

    def to_bytes(self) -> bytes:
        return b"".join(self.chunks())


class Signer:
    """Signs one sender's frames: a random sender id, and numbers that never repeat.

    Args:
        secret: the cluster secret.
        task: the sending task's name, e.g. ``chief:0`` (signed; servers count a chief's frames
            as a sign of life).
    """

    def __init__(self, secret: bytes, task: str = "") -> None:
        if len(task.encode()) > _MAX_TASK_BYTES:
            raise ValueError(f"task name too long: {task!r}")
        self.secret, self.task = secret, task
        self.sender = secrets.token_bytes(16)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def next_seq(self) -> int:
        with self._lock:
            return next(self._seq)

    def encode(
        self,
        method: str,
        header: Mapping[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        blobs: Sequence[bytes] = (),
        *,
        reply_to: Head | None = None,
    ) -> Frame:
        """A signed frame for ``method`` (a call, or with ``reply_to`` the answer to that call)."""
        parts: list[list[Any]] = [["t", dtype_name(t.dtype), list(t.shape)] for t in tensors]
        parts += [["b", len(b)] for b in blobs]
        head = json.dumps({**(header or {}), "parts": parts}, separators=(",", ":")).encode()
        prefix = [_LENGTHS.pack(len(head), sum(len(b) for b in blobs)), head, *blobs]
        length = sum(len(p) for p in prefix)
        body: list[Any] = [b"".join(prefix)]
        for t in tensors:
            view = _tensor_bytes(t)
            if len(view):
                if _pad(length):
                    body.append(bytes(_pad(length)))
                    length += _pad(length)
                body.append(view)
                length += len(view)
        return Frame(self, method, body, length, reply_to)


class ReplayGuard:
    """Admits each (sender, seq) once, within ``window`` numbers of the sender's newest and
    ``skew`` seconds of this clock (see the module docstring). Thread-safe.

    It remembers the ``max_senders`` most recently seen senders (each channel that ever talked to
    this server is one; a restarted task brings new ones).
    """

    def __init__(
        self,
        window: int = REPLAY_WINDOW,
        skew: float | None = None,
        max_senders: int = MAX_SENDERS,
        clock: Any = time.time,
    ) -> None:
        self.window, self.max_senders, self._clock = window, max_senders, clock
        self.skew = clock_skew() if skew is None else skew
        self._senders: OrderedDict[bytes, list[int]] = OrderedDict()  # sender -> [newest seq, bitmap of seen]
        self._lock = threading.Lock()

    def admit(self, head: Head) -> None:
        """Raises AuthenticationError for a replayed, too old or mistimed frame; else records it."""
        off = head.time - self._clock()
        if not abs(off) <= self.skew:
            raise AuthenticationError(
                f"message refused: signed {abs(off):.1f}s {'in the future' if off > 0 else 'ago'}, more than the "
                f"{CLOCK_SKEW_ENV} tolerance of {self.skew:g}s (a replay, or clocks that differ)",
                hint=f"synchronise the hosts' clocks (NTP) or raise {CLOCK_SKEW_ENV}",
            )
        with self._lock:
            entry = self._senders.get(head.sender)
            if entry is None:
                if len(self._senders) >= self.max_senders:
                    self._senders.popitem(last=False)
                self._senders[head.sender] = [head.seq, 1]
                return
            self._senders.move_to_end(head.sender)
            newest, seen = entry
            if head.seq > newest:
                shift = head.seq - newest
                entry[0] = head.seq
                entry[1] = ((seen << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
                return
            age = newest - head.seq
            if age >= self.window:
                raise AuthenticationError(
                    f"message refused: frame {head.seq} is {age} frames older than its "
                    f"sender's newest (window {self.window}): reordered or replayed"
                )
            if seen >> age & 1:
                raise AuthenticationError(
                    f"message refused: frame {head.seq} of this sender was received before (a replay)"
                )
            entry[1] = seen | (1 << age)


class _Reader:
    """Reads a frame's bytes from an iterator of chunks, holding one chunk at a time."""

    def __init__(self, chunks: Iterable[Any]) -> None:
        self._it = iter(chunks)
        self._buf = memoryview(b"")
        self._immutable = True

    def _fill(self) -> bool:
        while not len(self._buf):
            try:
                chunk = next(self._it)
            except StopIteration:
                return False
            self._buf, self._immutable = memoryview(chunk), isinstance(chunk, bytes)
        return True

    def read(self, n: int) -> bytes | None:
        out = []
        while n:
            if not self._fill():
                return None
            take = self._buf[:n]
            out.append(take)
            self._buf = self._buf[len(take) :]
            n -= len(take)
        return b"".join(out)

    def peek(self, n: int) -> memoryview | None:
        """The next ``n`` bytes, without consuming them, if the current chunk holds them all and
        cannot change (``bytes``: what is tagged there is what :meth:`read_into` copies)."""
        if not self._fill() or len(self._buf) < n or not self._immutable:
            return None
        return self._buf[:n]

    def read_into(self, target: memoryview, mac: _BodyMac | None = None) -> bool:
        """Fills ``target``; ``mac`` (if given) is fed the same bytes, from the chunk before the
        copy when it cannot change (the copy then reads bytes that are in the cache), else from
        ``target`` after it."""
        at = 0
        while at < len(target):
            if not self._fill():
                return False
            take = self._buf[: len(target) - at]
            if mac is not None and self._immutable:
                mac.update(take)
            target[at : at + len(take)] = take
            if mac is not None and not self._immutable:
                mac.update(target[at : at + len(take)])
            self._buf = self._buf[len(take) :]
            at += len(take)
        return True

    def at_end(self) -> bool:
        return not self._fill()


_REFUSED = "message refused: bad signature (wrong cluster secret, or not a phalanx frame)"


class Verifier:
    """Checks and parses frames.

    Args:
        secret: the cluster secret.
        guard: refuses replays of calls (servers); None for a client, whose replies are bound to
            its calls instead.
        max_unverified: how many frames may be read at once before their head is verified; more
            are refused at once (``OverloadedError``), so a flood of unsigned streams costs a
            bounded amount of memory.
    """

    def __init__(self, secret: bytes, guard: ReplayGuard | None = None, max_unverified: int = 16) -> None:
        self._secret, self._guard = secret, guard
        self.max_unverified = max_unverified
        self._slots = threading.BoundedSemaphore(max_unverified)

    def decode(self, method: str, chunks: Iterable[Any], *, reply_to: Head | None = None) -> Message:
        """Verifies and parses a frame read from ``chunks``.

        Raises:
            AuthenticationError: the signature is wrong, the frame is a replay, or it answers
                another call (nothing was parsed).
            OverloadedError: too many frames are being verified at once.
            ProtocolError: the signed frame is malformed.
        """
        if not self._slots.acquire(blocking=False):
            raise OverloadedError(f"more than {self.max_unverified} requests are being verified at once")
        try:
            reader = _Reader(chunks)
            head, fields = self._verify_head(method, reader, reply_to)
        finally:
            self._slots.release()
        mac = _BodyMac(_body_key(self._secret, method, fields), _body_nonce(head), head.body_len)
        # Each byte is tagged where the transport delivered it, before it is copied out (the copy
        # then reads cached bytes): a body that came in one message (see Frame.chunks) in one
        # call, a longer one chunk by chunk.
        received = reader.peek(head.body_len)
        body = bytearray(head.body_len)  # calloc'd: memory is committed as the body arrives
        if received is not None:
            expected = mac.of(received)
            whole = reader.read_into(memoryview(body))
        else:
            whole = reader.read_into(memoryview(body), mac)
            expected = mac.finalize()
        tag = reader.read(_TAG_BYTES) if whole else None
        if tag is None or not reader.at_end():
            raise AuthenticationError("message refused: its length differs from the signed length")
        if not hmac.compare_digest(expected, tag):
            raise AuthenticationError(
                "message refused: the payload (tensor, header or blob bytes) does not match "
                "its signature: it was altered on the way"
            )
        return _parse(body, head)

    def _verify_head(self, method: str, reader: _Reader, reply_to: Head | None) -> tuple[Head, bytes]:
        fixed = reader.read(_FIXED.size)
        if fixed is None or fixed[:4] != MAGIC:
            raise AuthenticationError(_REFUSED)
        _, mac, kind, sender, seq, stamp, body_len, r_sender, r_seq, task_len = _FIXED.unpack(fixed)
        task = reader.read(task_len)
        if task is None:
            raise AuthenticationError(_REFUSED)
        fields = fixed[_SIGNED_AT:] + task
        if not hmac.compare_digest(mac, _head_mac(self._secret, method, fields)):
            raise AuthenticationError(_REFUSED)
        head = Head(kind, sender, seq, stamp, body_len, r_sender, r_seq, task.decode(errors="replace"))
        if reply_to is None:
            if kind != CALL:
                raise AuthenticationError("message refused: a reply sent as a call")
            if self._guard is not None:
                self._guard.admit(head)
        elif kind != REPLY or (r_sender, r_seq) != (reply_to.sender, reply_to.seq):
            raise AuthenticationError("message refused: a reply that does not answer this call (replayed?)")
        return head, fields


def _parse(body: bytearray, head: Head) -> Message:
    view = memoryview(body)
    if len(view) < _LENGTHS.size:
        raise ProtocolError("message too short")
    head_len, blobs_len = _LENGTHS.unpack_from(view, 0)
    if head_len > _MAX_HEADER_BYTES or _LENGTHS.size + head_len + blobs_len > len(view):
        raise ProtocolError("header or blobs overrun the message")
    try:
        header = json.loads(bytes(view[_LENGTHS.size : _LENGTHS.size + head_len]))
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict) or not isinstance(header.get("parts"), list):
        raise ProtocolError("header must be an object with a 'parts' list")
    msg = Message(header, head=head)
    blob_at = _LENGTHS.size + head_len
    signed_end = tensor_at = blob_at + blobs_len
    for part in header.pop("parts"):
        if not isinstance(part, list) or not part:
            raise ProtocolError(f"malformed part {part!r}")
        if part[0] == "t" and len(part) == 3:
            dtype = dtype_from_name(part[1])
            shape = part[2]
            # type() and not isinstance(): JSON true is a bool, which Python counts as an int.
            if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
                raise ProtocolError(f"malformed shape {shape!r} (a list of sizes, each an integer >= 0)")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if nbytes == 0:
                msg.tensors.append(torch.empty(shape, dtype=dtype))
                continue
            tensor_at += _pad(tensor_at)
            if tensor_at + nbytes > len(view):
                raise ProtocolError(f"tensor of shape {shape} overruns the message")
            # The tensor shares the frame's (writable, aligned) buffer: no copy.
            raw = torch.frombuffer(body, dtype=torch.uint8, count=nbytes, offset=tensor_at)
            msg.tensors.append(raw.view(dtype).reshape(shape))
            tensor_at += nbytes
        elif part[0] == "b" and len(part) == 2 and type(part[1]) is int and part[1] >= 0:
            if blob_at + part[1] > signed_end:
                raise ProtocolError("blob overruns the message")
            msg.blobs.append(bytes(view[blob_at : blob_at + part[1]]))
            blob_at += part[1]
        else:
            raise ProtocolError(f"malformed part {part!r}")
    if blob_at != signed_end or tensor_at != len(view):
        raise ProtocolError("the parts do not add up to the message's length")
    return msg
