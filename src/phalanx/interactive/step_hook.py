"""The one point where a strategy's step meets an interactive session (kept import-light).

``Strategy.run`` calls :func:`before_step` at the start of every step. Outside an interactive
session it does nothing; inside one it lets every replica stop at the same agreed step when the
user interrupts the kernel (see :meth:`phalanx.interactive.session.Session.request_stop`).
"""

from __future__ import annotations

from typing import Any

from phalanx._compat.python import show_traceback
from phalanx.launch import mode

session: Any = None  # the Session of this process, set while one is active (attach, detach)


def attach(new: Any, as_mode: mode.JobMode) -> None:
    """Makes ``new`` (replica 0's ``Session``, or a replica's ``ReplicaSession``) this process's
    session, and records what the process has become (:func:`phalanx.launch.mode.record`)."""
    global session
    session = new
    mode.record(as_mode, new.env, new)


def detach(old: Any) -> None:
    """``old`` has ended: the process has no session any more (unless another one replaced it)."""
    global session
    if session is old:
        session = None
    mode.forget(old)


class InterruptedAtStep(KeyboardInterrupt):
    """The user interrupted the session; every replica stops as it starts this same step."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(
            f"interrupted as every replica started step {step} of this cell "
            f"({step - 1} complete steps ran on each; the replicas are in step)"
        )


def short_traceback(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> list[str]:
    """IPython's display of an :class:`InterruptedAtStep`: one line (a full Keras stack takes seconds)."""
    stb = [f"{etype.__name__}: {value}"]
    show_traceback(shell, etype, value, stb)  # IPython leaves showing a custom exception to its handler
    return stb


def before_step() -> None:
    if session is not None:
        session.before_step()
