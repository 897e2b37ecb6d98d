"""TF's TPU names (``TPUStrategy``, ``TPUClusterResolver``): phalanx has no TPU support.

They exist so that TF code renamed to phalanx fails at the TPU line with a typed error that says
what to use instead (TF's own guide constructs them only where a TPU is attached), rather than
with an ``AttributeError`` at import.

Example:
    >>> import phalanx as px
    >>> try:
    ...     px.TPUStrategy()
    ... except px.errors.InvalidDeviceError as e:
    ...     e.device
    'TPU'
"""

from __future__ import annotations

from typing import Any, NoReturn

from phalanx.errors import InvalidDeviceError

_HINT = (
    "phalanx runs on CPUs and CUDA GPUs, not TPUs: use MirroredStrategy (one host) or "
    "MultiWorkerMirroredStrategy (several hosts)"
)


def _no_tpu() -> NoReturn:
    raise InvalidDeviceError("TPU", hint=_HINT)


class TPUClusterResolver:
    """``tf.distribute.cluster_resolver.TPUClusterResolver``: raises, there is no TPU to resolve.

    Raises:
        InvalidDeviceError: always (``device == "TPU"``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _no_tpu()


class TPUStrategy:
    """``tf.distribute.TPUStrategy`` (and ``experimental.TPUStrategy``): raises at construction.

    Raises:
        InvalidDeviceError: always (``device == "TPU"``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _no_tpu()
