"""Interrupts in a notebook session: the user's Ctrl-C, and a replica's failure, reaching every replica.

The :class:`~phalanx.interactive.session.Session` holds one :class:`Interrupts` (``session.interrupts``)
and keeps the cells; this is what happens between a cell's start and its end when it must stop:

* **The user's interrupt.** Replicas are in their own process group: the kernel's SIGINT reaches
  replica 0 only. If a strategy step has run in the cell, replica 0 chooses a stop step just past
  every replica's current one (shared counters, :mod:`phalanx.interactive.control`), and every
  replica raises ``InterruptedAtStep`` when it starts that step, so they all stop after the same
  number of complete steps. Otherwise (or at a second interrupt, or if no step starts within
  :data:`ESCALATE_S`, or the stop step is not reached within :data:`MAX_AGREED_STOP_S`) every
  replica is interrupted at once.
* **A replica's failure.** Replica 0 may be waiting for a failed replica in a collective it will
  never join: after :data:`FAILURE_GRACE_S` it is interrupted with that replica's error
  (:meth:`Interrupts.peer_failed`), raised only into the cell's own code.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Protocol

__all__ = ["ESCALATE_S", "FAILURE_GRACE_S", "MAX_AGREED_STOP_S", "Interrupts"]

FAILURE_GRACE_S = 0.75  # after one replica failed, how long the others get to end the cell themselves
ESCALATE_S = 1.0  # no step started for this long: the agreed stop becomes an immediate interrupt everywhere
MAX_AGREED_STOP_S = 10.0  # steps still starting, but the stop step not reached: the same
# Frames around a cell, not in it: a replica's error is never raised into them.
_AROUND_THE_CELL = ("phalanx.interactive.session", "phalanx.interactive.console", __name__)


class CellState(Protocol):
    """What :class:`Interrupts` reads of its session (a :class:`~phalanx.interactive.session.Session`)."""

    running: bool  # a cell is running
    cell: int  # which one
    closed: bool
    broken: str | None  # why the replicas cannot go on, if they cannot
    control: Any  # the replicas' step counters and the stop step (phalanx.interactive.control.Control)
    launcher: Any  # its NotebookLauncher, which signals the replicas

    def peer_error(self) -> BaseException | None: ...


class Interrupts:
    """How one session's cell is interrupted (see the module docstring); its state is the cell's.

    Args:
        session: the session whose cells these are.
        cond: the session's condition, under which a cell ends (a replica's failure interrupts
            replica 0 only while the cell runs).
    """

    def __init__(self, session: CellState, cond: threading.Condition) -> None:
        self._session = session
        self._cond = cond
        self.previous: Any = None  # the SIGINT handler the cell replaced (restored after it)
        self.stop_requested = False  # an agreed stop step was chosen
        self.stopped = False  # replica 0 reached it
        self.interrupted = False  # the user interrupted the cell in progress (replica 0's SIGINT)
        # (cell, rank): a replica failed the cell that replica 0 was still running after
        # FAILURE_GRACE_S; replica 0 is interrupted with that replica's error (see peer_failed).
        self.peer_failure: tuple[int, int] | None = None
        self.peer_raised = False  # that error was raised into the cell's own code (not its end)

    def start_cell(self) -> None:
        """A new cell: nothing asked of the replicas yet."""
        self.stop_requested = self.stopped = self.interrupted = self.peer_raised = False

    def catch_sigint(self) -> None:
        """Replica 0's SIGINT is handled here while the cell runs (from the main thread only)."""
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self.on_sigint)

    def end_cell(self) -> None:
        """The cell has ended: the SIGINT handler it replaced is back."""
        if self.previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None

    def stopped_by_peer(self, peer_error: object) -> bool:
        """Whether a replica's error stopped replica 0 mid-cell (raised into the cell's own code, not
        as it was ending); forgets that replica's failure for the next cell."""
        stopped = self.peer_raised and peer_error is not None
        self.peer_failure, self.peer_raised = None, False
        return stopped

    def on_sigint(self, signum: int, frame: Any) -> None:
        s = self._session
        peer_error = s.peer_error()
        if peer_error is not None:
            # Raised only into the cell's own code (the user's, torch's, phalanx's collectives):
            # a cell already ending (IPython's, the session's or the console's frames) fails with the replica's
            # report in after_cell anyway.
            if s.running and not _in_cell_machinery(frame):
                self.peer_raised = True
                raise peer_error
            return
        self.interrupted = True
        if (
            self.stop_requested
            or not s.running
            or s.broken
            or s.closed
            or threading.current_thread() is not threading.main_thread()
            or max(s.control.steps()) == 0
        ):
            self._interrupt_everyone(signum, frame)
            return
        self.stop_requested = True
        # A replica can be at most one step past the slowest one that gates a collective; +2 leaves
        # every replica room to finish the step it is in, and none can start the stop step first.
        s.control.stop = max(s.control.steps()) + 2
        threading.Thread(target=self._escalate_later, daemon=True).start()

    def peer_failed(self, cell: int, rank: int) -> None:
        """Replica ``rank`` failed ``cell``, which replica 0 is still running: end it there too.

        Replica 0 may be waiting for that replica in a collective it will never join (a loop
        whose step raised on replica 1 only), which would last until the collective timeout,
        minutes, and then name a timeout rather than the replica's error. It gets
        FAILURE_GRACE_S to end the cell by itself (its own error, or a cell that needed no
        collective); then it is interrupted, and the cell fails with the replica's error.
        """
        s = self._session
        deadline = time.monotonic() + FAILURE_GRACE_S
        while time.monotonic() < deadline:
            if not s.running or s.cell != cell or s.closed:
                return
            time.sleep(0.02)
        with self._cond:
            if not s.running or s.cell != cell or s.closed or self.peer_failure is not None:
                return
            self.peer_failure = (cell, rank)
            # Sent under the lock that after_cell takes to end the cell, so never after it ended:
            # on_sigint raises the replica's error in the main thread, or lets a cell that is
            # already ending end.
            os.kill(os.getpid(), signal.SIGINT)

    def stopped_as_asked(self, report: dict) -> bool:
        """Whether a replica's failed report is only the interrupt this session asked of it.

        After the user's interrupt, every replica stops at the agreed step (``InterruptedAtStep``)
        or, escalated, at once (``KeyboardInterrupt``), replica 0 included: no replica waits in a
        collective for it, and replica 0 must not be stopped again with its report (an
        interrupted replica 0 ends the cell out of step and the session with it).
        """
        return self.interrupted and report.get("type") in ("InterruptedAtStep", "KeyboardInterrupt")

    def _escalate_later(self) -> None:
        s = self._session
        # Steps still starting means the stop step will come (a loaded host makes steps slow); no
        # step started for ESCALATE_S means the replicas are somewhere else (data loading, a sleep).
        start = time.monotonic()
        seen, last_progress = s.control.steps(), start
        while s.running and not self.stopped:
            now = time.monotonic()
            steps = s.control.steps()
            if steps != seen:
                seen, last_progress = steps, now
            if now - last_progress > ESCALATE_S or now - start > MAX_AGREED_STOP_S:
                break
            time.sleep(0.02)
        if s.running and not self.stopped:
            os.kill(os.getpid(), signal.SIGINT)  # handled again: now an immediate interrupt everywhere

    def _interrupt_everyone(self, signum: int, frame: Any) -> None:
        s = self._session
        s.launcher.signal(signal.SIGINT)
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt


def _in_cell_machinery(frame: Any) -> bool:
    """Whether ``frame`` is IPython's, ipykernel's, the session's or the console's: around the cell, not in it."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name in _AROUND_THE_CELL or name.split(".", 1)[0] in ("IPython", "ipykernel", "code")
