"""Which Keras models are distributed, and by what: a side table from model to its adapter.

Kept apart from the adapters (:mod:`phalanx.keras.model`, :mod:`phalanx.keras.parameter_server`)
so that both can ask "is this model distributed?" without importing each other, and kept beside
the model rather than on it (no attribute is added to a Keras object).
"""

from __future__ import annotations

from typing import Any

from phalanx._sidetable import IdentityTable

_ADAPTERS: IdentityTable[Any] = IdentityTable()


def distributed_model(model: Any) -> Any:
    """The adaptation attached to ``model`` (a :class:`~phalanx.keras.DistributedModel`), or None."""
    return _ADAPTERS.get(model)


def attach(model: Any, adapter: Any) -> None:
    """Records ``adapter`` as the adaptation of ``model`` (for as long as the model lives)."""
    _ADAPTERS[model] = adapter
