"""``phalanx.experimental_set_strategy``: a strategy current for the whole program (TF's).

``experimental_set_strategy(s)`` is ``s.scope()`` entered for good: ``get_strategy()`` returns
``s`` and variables created from then on are distributed by it, until ``experimental_set_strategy(None)``
(or another strategy) leaves that scope. As in TF it must not be called inside a ``scope()``.
The scope belongs to the calling thread's context, as every phalanx scope does.

Example:
    >>> import phalanx as px
    >>> s = px.OneDeviceStrategy("cpu")
    >>> px.experimental_set_strategy(s)
    >>> px.get_strategy() is s
    True
    >>> px.experimental_set_strategy(None)
    >>> px.has_strategy()
    False
"""

from __future__ import annotations

from typing import Any

from phalanx.core import context
from phalanx.errors import StrategyScopeError

_current: dict[str, Any] = {"strategy": None, "scope": None}


def experimental_set_strategy(strategy: Any) -> None:
    """Makes ``strategy`` current for the whole program (``None`` clears it).

    Raises:
        StrategyScopeError: called inside a ``strategy.scope()`` block.
    """
    # Only the frame of the program-wide scope itself may be on the context stack.
    expected = 1 if _current["scope"] is not None else 0
    if len(context._STACK.get()) > expected:  # friend: only the stack's depth tells a nested scope
        raise StrategyScopeError(
            "experimental_set_strategy was called inside a strategy's scope (or run).",
            hint="call it at the top level of the program, outside `with strategy.scope():`",
        )
    if _current["scope"] is not None:
        scope, _current["scope"], _current["strategy"] = _current["scope"], None, None
        scope.__exit__(None, None, None)
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _current["strategy"], _current["scope"] = strategy, scope
