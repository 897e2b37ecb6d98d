"""The default strategy: what is current when no strategy's scope is open (one replica, no-op).

Defined in :mod:`phalanx.core.strategy` beside :class:`~phalanx.core.strategy.Strategy`; re-exported here
for code that imported it from this module.
"""

from __future__ import annotations

from phalanx.core.strategy import DefaultStrategy, default_strategy

__all__ = ["DefaultStrategy", "default_strategy"]
