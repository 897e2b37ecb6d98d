"""The plain Python REPL once an interactive session runs: each statement runs on every replica.

The C REPL gives no hook per statement; it does ask ``str(sys.ps1)`` before each one. So the
session makes ``sys.ps1`` a :class:`LeaderPrompt`, which at the next prompt runs a
:class:`Console` on the same ``__main__``: each complete statement is shipped to the replicas
(``session.before_cell``), run here, and its outcome on every replica collected
(``session.after_cell``), as IPython's ``pre_run_cell``/``post_run_cell`` events do in a notebook.
"""

from __future__ import annotations

import code
import os
import sys
from typing import Any

from phalanx.interactive import step_hook

__all__ = ["Console", "LeaderPrompt", "end_input"]


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
