"""An uncaught configuration error reads as the program's own frames and the error's line.

A TF_CONFIG typo, a malformed ``PHALANX_*`` variable or a device this host lacks is found deep
inside phalanx (the strategy, the resolver, the validation): Python's traceback showed eight of
phalanx's frames before the one line that says what is wrong and how to fix it. The first
:class:`~phalanx.errors.ConfigurationError` made calls :func:`install`, which wraps
``sys.excepthook`` (whatever hook was there, a launcher's included, still runs); if that error ends
the program, its traceback keeps the program's frames only, with a note saying ``PHALANX_DEBUG=1``
shows the rest. Every other exception passes through unchanged. IPython shows a cell's errors itself.

Example:
    >>> program = {"__name__": "__main__"}
    >>> exec("def make_strategy():\\n    raise ValueError('typo')", program)
    >>> try:
    ...     program["make_strategy"]()
    ... except ValueError as e:
    ...     kept = [t.tb_frame.f_code.co_name for t in _walk(without_phalanx_frames(e.__traceback__))]
    >>> kept  # this doctest's own frame is this module's, phalanx's: the program's alone is kept
    ['make_strategy']
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from typing import Any

DEBUG_VARIABLE = "PHALANX_DEBUG"  # 1: show phalanx's frames too (phalanx.config.Settings.debug)
_hidden: tuple[type[BaseException], ...] = ()  # the kinds of error whose phalanx frames are hidden


def _walk(tb: types.TracebackType | None) -> Iterator[types.TracebackType]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _phalanx_frame(tb: types.TracebackType) -> bool:
    name = tb.tb_frame.f_globals.get("__name__", "")
    return isinstance(name, str) and (name == "phalanx" or name.startswith("phalanx."))


def without_phalanx_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """A new traceback of ``tb``'s frames that are not phalanx's (the same frames, in order)."""
    kept = [t for t in _walk(tb) if not _phalanx_frame(t)]
    trimmed = None
    for t in reversed(kept):
        trimmed = types.TracebackType(trimmed, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return trimmed


def debugging() -> bool:
    """Whether ``PHALANX_DEBUG=1`` asks for phalanx's frames (read here, never validated: this
    runs while an error ends the program)."""
    return os.environ.get(DEBUG_VARIABLE, "").strip() == "1"


def install(kind: type[BaseException]) -> None:
    """Wraps ``sys.excepthook`` (once), so that an uncaught ``kind`` hides phalanx's frames."""
    global _hidden
    if kind in _hidden:
        return
    first = not _hidden
    _hidden += (kind,)
    if not first:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, _hidden) and not debugging():
            tb = without_phalanx_frames(tb)
            value.with_traceback(tb)
            value.__cause__, value.__suppress_context__ = None, True  # phalanx's own parsing errors
            note = f"(phalanx's own frames are hidden; {DEBUG_VARIABLE}=1 shows them)"
            if hasattr(value, "add_note"):
                if note not in getattr(value, "__notes__", ()):
                    value.add_note(note)
            else:  # Python 3.10: no notes
                print(note, file=sys.stderr, flush=True)
        previous(kind, value, tb)

    sys.excepthook = hook
