"""Which Keras phalanx.keras supports, checked before anything touches Keras' internals.

Kept free of Keras imports so that the check itself can be tested without Keras.

Example:
    >>> check_keras_version("3.15.1", "torch")
    >>> try:
    ...     check_keras_version("2.15.0", "torch")
    ... except UnsupportedKerasError as e:
    ...     print(e)
    phalanx.keras supports Keras >=3.6,<3.16; found keras 2.15.0. HINT: pip install -e '.[keras]'
"""

from __future__ import annotations

import re

from phalanx.errors import PhalanxError

MIN_VERSION = (3, 6)
MAX_VERSION = (3, 16)  # exclusive: the instance-level adaptation relies on the torch trainer of these releases
SUPPORTED = f">={MIN_VERSION[0]}.{MIN_VERSION[1]},<{MAX_VERSION[0]}.{MAX_VERSION[1]}"


class UnsupportedKerasError(PhalanxError, ImportError):
    """The installed Keras (or its backend) is one phalanx.keras does not work with."""


def parse_version(version: str) -> tuple[int, int]:
    """``"3.15.1"`` -> ``(3, 15)``; pre-release and local suffixes are ignored."""
    match = re.match(r"^\s*(\d+)\.(\d+)", str(version))
    if not match:
        raise UnsupportedKerasError(
            f"Cannot read the Keras version {version!r}.",
            hint=f"install Keras {SUPPORTED}: pip install -e '.[keras]'",
        )
    return int(match.group(1)), int(match.group(2))


def check_keras_version(version: str, backend: str) -> None:
    """Raises :class:`UnsupportedKerasError` unless ``version`` is supported and ``backend`` is torch."""
    if not MIN_VERSION <= parse_version(version) < MAX_VERSION:
        raise UnsupportedKerasError(
            f"phalanx.keras supports Keras {SUPPORTED}; found keras {version}.", hint="pip install -e '.[keras]'"
        )
    if backend != "torch":
        raise UnsupportedKerasError(
            f"phalanx.keras needs Keras' torch backend; Keras was imported with the {backend!r} backend.",
            hint="set KERAS_BACKEND=torch before the first `import keras` (or import phalanx.keras first)",
        )
