"""The launchers' view of :mod:`phalanx.config`: each setting read when asked for.

A launcher runs for the whole job, and a test or a user may set a variable just before starting
one, so these read a fresh :func:`phalanx.config.settings` snapshot each time (a malformed value
is a :class:`~phalanx.errors.ClusterSpecError` naming the variable and the value).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile

from phalanx import config
from phalanx.errors import ClusterSpecError


def log_root() -> str:
    """Where run directories go: ``PHALANX_LOG_ROOT``, else ``<temp dir>/phalanx-logs``."""
    return config.settings().log_root or os.path.join(tempfile.gettempdir(), "phalanx-logs")


def keep_runs() -> int:
    """How many run directories the log root keeps (``PHALANX_KEEP_RUNS``, at least 1)."""
    keep = config.settings().keep_runs
    if keep < 1:
        raise ClusterSpecError("PHALANX_KEEP_RUNS", keep, "must be at least 1 (the run being started)")
    return keep


def exit_timeout() -> float:
    """Seconds the other replicas get to finish once replica 0 has finished normally."""
    return config.settings().exit_timeout


def stop_grace() -> float:
    """Seconds between the polite signal and SIGKILL when a failed or interrupted job is stopped."""
    return config.settings().stop_grace


def start_method() -> str:
    """How launchers start replica processes: ``PHALANX_START_METHOD``, else ``fork`` on Linux
    (:mod:`phalanx.launch.forkserver`) and ``spawn`` elsewhere."""
    raw = config.settings().start_method
    if raw in (None, ""):
        return "fork" if sys.platform.startswith("linux") else "spawn"
    if raw not in ("fork", "spawn"):
        raise ClusterSpecError("PHALANX_START_METHOD", raw, "must be fork or spawn")
    if raw == "fork" and not sys.platform.startswith("linux"):
        raise ClusterSpecError("PHALANX_START_METHOD", raw, "the fork start needs Linux; use spawn")
    return raw


def preemption_grace() -> float:
    """Seconds replicas get to save after the launcher was told to stop with SIGTERM."""
    return config.settings().preemption_grace


def stack_signal() -> signal.Signals:
    """The signal that makes a launched replica write its Python stacks to its log (``PHALANX_STACK_SIGNAL``)."""
    return config.stack_signal()
