"""The MACs of a parameter-server frame: the head's HMAC and the body's one-time tag.

A frame's head is authenticated by HMAC-SHA256 under the cluster secret (:func:`_head_mac`); its
body by a tag under a key that only this head gives (:func:`_body_key`): AES-256-GMAC, or keyed
BLAKE2b for a small body (:class:`_BodyMac`). Why each is safe and what each costs is in
:mod:`phalanx.ps.wire`, which builds and checks the frames.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

_GCM: tuple[Any, Any, Any, Any] | None = None


def _gcm() -> tuple[Any, Any, Any, Any]:
    global _GCM
    if _GCM is None:  # imported once: a from-import costs about 1 us each time it runs
        try:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "ParameterServerStrategy signs its messages with the 'cryptography' package: pip install -e '.[ps]'"
            ) from e
        _GCM = (AESGCM, Cipher, algorithms, modes)
    return _GCM


# cryptography's one-shot AESGCM takes at most 2**31 - 1 bytes of associated data; longer buffers
# are fed to the streaming interface in slices of this size (the tag is the same either way).
_ONE_SHOT_MAX = 1 << 30
# Bodies up to this size (calls without tensors, replies) are tagged with keyed BLAKE2b (in
# Python itself: 30 us a call with cold caches, against 70 us for a call into OpenSSL; it runs at
# 0.6 GB/s, so larger bodies take GMAC).
_SMALL_BODY = 4 << 10


class _BodyMac:
    """The 16-byte tag of a body of ``length`` bytes, fed in pieces in order (``update``,
    ``finalize``) or whole (``of``): AES-256-GMAC, or keyed BLAKE2b for a small body.

    GMAC is AES-GCM with no plaintext and the data as associated data: a universal hash (GHASH)
    of the data, masked by AES of the nonce. Its security needs each (key, nonce) pair to sign
    one message only: a second tag under the same pair reveals the hash key and lets anyone
    forge. Each frame's key is its own: HMAC-SHA256 of the cluster secret, the method and the
    signed head fields (:func:`_body_key`), and those fields hold the sender's 16 random bytes
    and its sequence number, which a :class:`Signer` never repeats (a renewed frame takes a new
    number), so two frames get independent keys (a collision has probability about 2**-128).
    The nonce, the sequence number and the sender's first bytes (:func:`_body_nonce`), is unique
    for that sender too: a second line of defence. A receiver that recomputes the tag over an
    altered body learns nothing but a mismatch (compared in constant time), so forging a tag
    succeeds with probability about ``length/16 * 2**-128``, as for any one-time GMAC key.
    Keyed BLAKE2b (RFC 7693's MAC mode) needs no nonce; it gets the same one-time key.
    """

    def __init__(self, key: bytes, nonce: bytes, length: int) -> None:
        self._key, self._nonce = key, nonce
        self._small = length <= _SMALL_BODY
        self._ctx: Any = None

    def update(self, piece: Any) -> None:
        if self._ctx is None:
            if self._small:
                self._ctx = hashlib.blake2b(key=self._key, digest_size=16)
            else:
                _, cipher, algorithms, modes = _gcm()
                self._ctx = cipher(algorithms.AES(self._key), modes.GCM(self._nonce)).encryptor()
        if self._small:
            self._ctx.update(piece)  # hashed now: the caller's buffer may change afterwards
            return
        view = memoryview(piece)
        for at in range(0, len(view), _ONE_SHOT_MAX):
            self._ctx.authenticate_additional_data(view[at : at + _ONE_SHOT_MAX])

    def finalize(self) -> bytes:
        if self._ctx is None:
            self.update(b"")
        if self._small:
            return self._ctx.digest()
        self._ctx.finalize()
        return self._ctx.tag

    def of(self, body: Any) -> bytes:
        """The tag of a whole body in one buffer, in one call when it can (instead of ``update`` and ``finalize``).

        A one-shot call costs 2 us before it reads a byte (60 us after the caches were flushed),
        a streaming context 11 us (160 us): see the module docstring.
        """
        if self._small:
            return hashlib.blake2b(body, key=self._key, digest_size=16).digest()
        if len(body) > _ONE_SHOT_MAX:
            self.update(body)
            return self.finalize()
        return _gcm()[0](self._key).encrypt(self._nonce, b"", body)


def _label(purpose: bytes, method: str) -> bytes:
    return b"phalanx-" + purpose + b"\0" + method.encode() + b"\0"


def _body_key(secret: bytes, method: str, fields: bytes) -> bytes:
    return hmac.new(secret, _label(b"body-key", method) + fields, hashlib.sha256).digest()


def _head_mac(secret: bytes, method: str, fields: bytes) -> bytes:
    return hmac.new(secret, _label(b"head", method) + fields, hashlib.sha256).digest()
