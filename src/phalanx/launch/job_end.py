"""How a launcher's job ends: signals turned into a stop, and the wait for the rest after replica 0.

``phalanx run``, self-launch and the parameter-server launcher share this end-of-job policy on top
of :class:`~phalanx.launch.supervisor.Supervisor`: SIGTERM/SIGINT to the launcher become
:class:`Interrupted` in its loop (:func:`forwarded_signals`) and are passed once to every task
(:func:`stop_on_signal`); after the primary task finished normally, the others get
``PHALANX_EXIT_TIMEOUT`` to finish (:func:`wait_for_the_rest`), and one still running its program
then is the root cause, named with its stack.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator, Sequence

from phalanx.launch import settings
from phalanx.launch.root_cause import Running, who
from phalanx.launch.supervisor import Supervisor

__all__ = ["Interrupted", "forwarded_signals", "lingering", "stop_on_signal", "wait_for_the_rest"]


class Interrupted(Exception):
    """The supervisor was told to stop (SIGTERM, SIGINT); ``signum`` says how."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def forwarded_signals() -> Iterator[None]:
    """Turns SIGTERM/SIGINT to this process into :class:`Interrupted` in the main thread's loop."""

    def on_signal(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def stop_on_signal(sup: Supervisor, signum: int) -> int:
    """Forwards ``signum`` to every task, waits its grace period, kills the rest; the exit status."""
    grace = settings.preemption_grace() if signum == signal.SIGTERM else settings.stop_grace()
    name = signal.Signals(signum).name
    sup.say(f"received {name}; passing it to {len(sup.alive())} task(s) (up to {grace:g} s before SIGKILL)")
    # Ignore further signals while stopping: a second one must not abandon children half-stopped.
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sup.stop(signum, grace)
    sup.poll()
    return 128 + signum


def lingering(runs: Sequence[Running]) -> list[Running]:
    """Of ``runs``, those still running their program (not merely tearing down after it finished)."""
    return [r for r in runs if not r.done]


def wait_for_the_rest(
    sup: Supervisor, *, primary: str = "replica 0", notice_after: float = 2.0, limit: float | None = None
) -> int:
    """After ``primary`` finished normally: the others get ``limit`` seconds (default
    ``PHALANX_EXIT_TIMEOUT``) to finish.

    One still running its program after that is a failure: it is named with its stack (the root
    cause), the rest are stopped, and the status is 1. The wait is announced after
    ``notice_after`` seconds, never silent. A failure meanwhile is reported as usual. A task that
    finished its program and is only tearing down is stopped without failing the job.

    Returns:
        0, or the exit status of the failure.
    """
    limit = settings.exit_timeout() if limit is None else limit
    start = time.monotonic()
    noticed = False
    while True:
        ended = sup.poll()
        if any(e.failed for e in ended) or sup.failing():
            sup.stop_after_failure()
            cause = sup.report_root_cause()
            return cause.status or 1 if cause is not None else 1
        alive = sup.alive()
        if not alive:
            return 0
        busy = lingering(alive)
        waited = time.monotonic() - start
        if busy and not noticed and waited >= notice_after:
            noticed = True
            sup.say(
                f"{primary} has finished; waiting up to {limit:g} s for "
                + ", ".join(f"{r.task.name} (pid {r.pid})" for r in busy)
                + " to finish"
            )
        if waited >= limit:
            if not busy:
                sup.say(
                    ", ".join(r.task.name for r in alive) + f" finished but still tore down {limit:g} s later; stopped"
                )
                sup.kill()
                sup.poll()
                return 0
            stacks = sup.dump_stacks(busy)
            first = busy[0]
            sup.say(
                f"root cause (first failure): {who(first.task, first.pid)} was still running {limit:g} s after "
                f"{primary} finished normally (blocked in a collective that {primary} never joined, or "
                f"a program that does more on some replicas). Where it was:\n"
                + "\n".join(stacks.get(first.task.name, "").splitlines()[-40:])
            )
            sup.note_cause_reported()
            if len(busy) > 1:
                sup.say("also still running: " + ", ".join(f"{r.task.name} (pid {r.pid})" for r in busy[1:]))
            sup.stop(signal.SIGTERM)
            sup.poll()
            return 1
        time.sleep(0.05)
