"""Moved: ParameterServerStrategy lives beside its coordinator, in :mod:`phalanx.ps.strategy`.

Kept so that code importing it from here goes on working.
"""

from phalanx.ps.strategy import ParameterServerExtended, ParameterServerStrategy

__all__ = ["ParameterServerExtended", "ParameterServerStrategy"]
