"""``phalanx.RunOptions``: options of ``strategy.run`` (TF's; its fields tune TPU compilation).

Example:
    >>> import phalanx as px
    >>> px.RunOptions(experimental_enable_dynamic_batch_size=True).experimental_enable_dynamic_batch_size
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunOptions:
    """Accepted by ``strategy.run(options=...)``. Every field concerns TPU/XLA compilation in TF,
    which phalanx does not do: shapes are always dynamic and nothing is compiled, so they have no effect."""

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None
