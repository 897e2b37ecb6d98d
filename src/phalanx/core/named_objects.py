"""The objects a step function names: what ``strategy.run`` can find without being told.

A TF custom loop names its optimizer and metrics in the step function it gives ``strategy.run``
(globals or closure); phalanx finds them there: Keras metrics and variables (``phalanx.keras``),
torch optimizers whose state a replacement replica must receive (:mod:`phalanx.core.rejoin`).

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> def step():
    ...     opt.step()
    >>> objects_used_by(step, torch.optim.Optimizer) == [opt]
    True
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

_DEPTH = 2  # functions named by the step function, and those they name, are followed


def objects_used_by(fn: Callable[..., Any], kind: type) -> list[Any]:
    """The objects of ``kind`` that ``fn`` names (globals, closure, directly or in a list / tuple / dict),
    following the functions it names ``_DEPTH`` deep, in the order found."""
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def visit(f: Any, depth: int) -> None:
        f = getattr(f, "__func__", f)  # bound methods
        code = getattr(f, "__code__", None)
        if code is None or id(f) in seen:
            return
        seen.add(id(f))
        values = [f.__globals__[n] for n in code.co_names if n in getattr(f, "__globals__", {})]
        values += [c.cell_contents for c in (f.__closure__ or ()) if _filled(c)]
        for v in values:
            for item in v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(item, kind):
                    found.setdefault(id(item), item)
                elif depth > 0 and isinstance(item, (types.FunctionType, types.MethodType)):
                    visit(item, depth - 1)

    visit(fn, _DEPTH)
    return list(found.values())


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents  # raises for a cell not filled yet
    except ValueError:
        return False
    return True
