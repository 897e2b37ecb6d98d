"""Every ``PHALANX_*`` setting the launchers read, in one place.

Each is read when asked for (a test or a user may set it just before starting a job) and a
malformed value is a :class:`~phalanx.errors.ClusterSpecError` naming the variable and the value.

==========================  =====================================================  ==========
variable                    meaning                                                default
==========================  =====================================================  ==========
``PHALANX_LOG_ROOT``        the directory that holds one sub-directory per run      temp dir
``PHALANX_KEEP_RUNS``       run directories kept there (older ones are deleted)    10
``PHALANX_EXIT_TIMEOUT``    seconds the other replicas get to finish after         10
                            replica 0 finished normally
``PHALANX_STOP_GRACE``      seconds a stopped replica gets between SIGTERM/SIGINT  1.5
                            and SIGKILL when the job fails or is interrupted
``PHALANX_PREEMPTION_GRACE``  seconds replicas get to save after the launcher      30
                            received SIGTERM (preemption)
==========================  =====================================================  ==========
"""

from __future__ import annotations

import os
import tempfile

from phalanx.errors import ClusterSpecError

DEFAULT_KEEP_RUNS = 10
DEFAULT_EXIT_TIMEOUT = 10.0
DEFAULT_STOP_GRACE = 1.5
DEFAULT_PREEMPTION_GRACE = 30.0


def _number(name: str, default: float, *, integer: bool = False, minimum: float = 0.0) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ClusterSpecError(name, raw, "must be an integer" if integer else "must be a number of seconds") from None
    if value < minimum:
        raise ClusterSpecError(name, raw, f"must be at least {minimum:g}")
    return value


def log_root() -> str:
    """Where run directories go: ``PHALANX_LOG_ROOT``, else ``<temp dir>/phalanx-logs``."""
    return os.environ.get("PHALANX_LOG_ROOT") or os.path.join(tempfile.gettempdir(), "phalanx-logs")


def keep_runs() -> int:
    """How many run directories the log root keeps (``PHALANX_KEEP_RUNS``, at least 1)."""
    return int(_number("PHALANX_KEEP_RUNS", DEFAULT_KEEP_RUNS, integer=True, minimum=1))


def exit_timeout() -> float:
    """Seconds the other replicas get to finish once replica 0 has finished normally."""
    return _number("PHALANX_EXIT_TIMEOUT", DEFAULT_EXIT_TIMEOUT)


def stop_grace() -> float:
    """Seconds between the polite signal and SIGKILL when a failed or interrupted job is stopped."""
    return _number("PHALANX_STOP_GRACE", DEFAULT_STOP_GRACE)


def preemption_grace() -> float:
    """Seconds replicas get to save after the launcher was told to stop with SIGTERM."""
    return _number("PHALANX_PREEMPTION_GRACE", DEFAULT_PREEMPTION_GRACE)
