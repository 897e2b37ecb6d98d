"""The console of an interactive session: how each cell (or statement) reaches every replica.

In IPython (a notebook's kernel, IPython's terminal), :class:`ShellEvents` hooks the shell's
``pre_run_cell`` and ``post_run_cell`` events: each cell is shipped to the replicas before it runs
here (``session.before_cell``), and its outcome on every replica is collected after it
(``session.after_cell``). The plain REPL gives no hook per statement; it does ask
``str(sys.ps1)`` before each one. So the session makes ``sys.ps1`` a :class:`LeaderPrompt`, which
at the next prompt runs a :class:`Console` on the same ``__main__`` that does the same per
statement. :func:`attach` chooses; the session keeps the cells themselves.
"""

from __future__ import annotations

import code
import os
import sys
from typing import Any

from phalanx.interactive import step_hook

__all__ = ["Console", "LeaderPrompt", "ShellEvents", "attach", "end_input"]


class Console(code.InteractiveConsole):
    """The plain REPL once a session runs: each complete statement runs on every replica."""

    def __init__(self, session: Any, namespace: dict) -> None:
        super().__init__(namespace, filename="<stdin>")
        self.session = session

    def runsource(self, source: str, filename: str = "<stdin>", symbol: str = "single") -> bool:
        try:
            compiled = self.compile(source, filename, symbol)
        except (OverflowError, SyntaxError, ValueError):
            self.showsyntaxerror(filename)
            return False
        if compiled is None:
            return True
        session = step_hook.session or self.session
        session.before_cell(source)
        error = None
        try:
            exec(compiled, self.locals)
        except SystemExit:  # exit(): end the input, so that the REPL itself ends as usual
            session.after_cell(None)
            end_input()
            return False
        except BaseException as e:  # noqa: BLE001 - shown like the REPL does
            error = e
            self.showtraceback()
        failure = session.after_cell(error)
        if failure is not None:
            print(f"{type(failure).__name__}: {failure}", file=sys.stderr, flush=True)
        return False


def end_input() -> None:
    """Points stdin at /dev/null: the console, then the C REPL, read end of input and stop."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


class LeaderPrompt:
    """sys.ps1 of the REPL once a session runs: at the next prompt, read statements ourselves.

    The C REPL gives no hook per statement; it does ask ``str(sys.ps1)`` before each one. The
    first time, this runs a :class:`Console` on the same ``__main__`` until end of input (or
    ``exit()``, whose exit status is not kept), then lets the REPL read end of input and exit.
    """

    def __init__(self, session: Any, prompt: Any) -> None:
        self.session, self.prompt = session, prompt
        self.last_error = getattr(sys, "last_value", None)

    def __str__(self) -> str:
        sys.ps1 = self.prompt if not isinstance(self.prompt, LeaderPrompt) else ">>> "
        # The statement that created the strategy: the C REPL has shown its own error, if any
        # (it leaves it in sys.last_value); a replica's failure it did not show is shown here.
        error = getattr(sys, "last_value", None)
        failure = self.session.after_cell(error if error is not self.last_error else None)
        if failure is not None:
            print(f"{type(failure).__name__}: {failure}", file=sys.stderr, flush=True)
        Console(self.session, sys.modules["__main__"].__dict__).interact(banner="", exitmsg="")
        self.session.close()
        end_input()
        return ""


class ShellEvents:
    """IPython's side of a session: its ``pre_run_cell`` / ``post_run_cell`` events, and the short
    traceback of a cell stopped at the agreed step (unless the user set a handler of their own)."""

    def __init__(self, session: Any, shell: Any) -> None:
        self.session, self.shell = session, shell

    def attach(self) -> None:
        self.shell.events.register("pre_run_cell", self._pre_run_cell)
        self.shell.events.register("post_run_cell", self._post_run_cell)
        if not self.shell.custom_exceptions:  # never replace a handler the user set
            self.shell.set_custom_exc((step_hook.InterruptedAtStep,), step_hook.short_traceback)

    def detach(self) -> None:
        for event, callback in (("pre_run_cell", self._pre_run_cell), ("post_run_cell", self._post_run_cell)):
            try:
                self.shell.events.unregister(event, callback)
            except ValueError:
                pass
        if self.shell.custom_exceptions == (step_hook.InterruptedAtStep,):
            self.shell.set_custom_exc((), None)

    def _pre_run_cell(self, info: Any) -> None:
        self.session.before_cell(info.raw_cell)

    def _post_run_cell(self, result: Any) -> None:
        error = (result.error_before_exec or result.error_in_exec) if result is not None else None
        failure = self.session.after_cell(error)
        if failure is None or result is None:
            return
        # Shown as the cell's own error: its message carries the replica's traceback. Raised
        # here so that it has a traceback object (IPython 8.0's formatter requires one); the
        # offset hides this frame.
        try:
            raise failure
        except type(failure):
            self.shell.showtraceback(tb_offset=1)
        result.error_in_exec = failure


def attach(session: Any, mode: str, shell: Any) -> ShellEvents | None:
    """Makes every cell (IPython) or statement (the plain REPL) of ``session`` run on every replica.

    Returns the IPython events to detach when the session closes (None for the REPL, whose
    console ends with its input, and for a program, which has no console).
    """
    if shell is not None:
        events = ShellEvents(session, shell)
        events.attach()
        return events
    if mode == "repl":
        sys.ps1 = LeaderPrompt(session, getattr(sys, "ps1", ">>> "))
    return None
