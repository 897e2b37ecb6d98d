"""The cluster secret's name and a fresh secret: what the launcher needs, without the wire (or torch).

Example:
    >>> len(generate_secret())
    64
"""

from __future__ import annotations

import secrets

SECRET_ENV = "PHALANX_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16


def generate_secret() -> str:
    """A fresh random secret (64 hex characters)."""
    return secrets.token_hex(32)
