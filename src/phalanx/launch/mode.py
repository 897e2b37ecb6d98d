"""How this process runs, decided in one place: its :class:`JobMode` and its identity in the job.

A process comes to run phalanx in one of six ways, and the answer decides who starts replicas,
who this process is, and how its job ends:

==========================  ===============================================================
``ENVIRONMENT``             a launcher started every process and put each one's identity in
                            its environment (``phalanx run``, torchrun, Slurm, ``TF_CONFIG``,
                            and replicas 1..N-1 of a self-launched script)
``SELF_LAUNCHED``           ``python train.py`` started replicas 1..N-1 itself; this is replica 0
``EMBEDDED_HOST``           the same, from Python embedded in another program (R through
                            reticulate): the replicas are fresh host processes, and the job ends
                            when the program closes its last strategy
``NOTEBOOK_SESSION``        replica 0 of an interactive session (a notebook, the REPL, ``-c``,
                            stdin): every cell runs on every replica
``NOTEBOOK_REPLICA``        replica k > 0 of such a session (forked or spawned by replica 0)
``ALONE``                   nobody launched this process and it started nobody
==========================  ===============================================================

As Accelerate's ``PartialState``, the answer is one shared record (:func:`current`), read by
everything that used to re-derive it: the chooser of a strategy's launcher
(:func:`phalanx.strategies.launchers.replicas`), process identity outside a strategy
(:mod:`phalanx.core.process`) and :mod:`phalanx.interactive`. A process's mode changes only when a
launcher starts or joins replicas: a notebook session and its replicas record it
(:func:`record`, from :mod:`phalanx.interactive.step_hook`); self-launch is read from the job it
keeps (:func:`phalanx.launch.self_launch.current_job`), which an embedded host's end clears; the
rest is read from the launcher's environment (:func:`phalanx.launch.launcher.job_env`). Those are read
at each call rather than cached, so that a test may change the environment.

Which mode *starting* replicas here would make is :func:`starting_mode`: a notebook session where
the interpreter has no script to start again (:func:`interactive_mode`), else self-launch.

Example:
    >>> from phalanx.launch import mode
    >>> mode.current().mode in (mode.JobMode.ALONE, mode.JobMode.ENVIRONMENT)
    True
"""

from __future__ import annotations

import enum
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

from phalanx.launch import host, self_launch
from phalanx.launch.env import ReplicaEnv
from phalanx.launch.launcher import Launcher, job_env

__all__ = [
    "JobMode",
    "ProcessRole",
    "current",
    "forget",
    "interactive_mode",
    "ipython_shell",
    "record",
    "starting_mode",
]


class JobMode(str, enum.Enum):
    """How this process runs (see the module docstring)."""

    ENVIRONMENT = "environment"
    SELF_LAUNCHED = "self-launched"
    EMBEDDED_HOST = "embedded host"
    NOTEBOOK_SESSION = "notebook session"
    NOTEBOOK_REPLICA = "notebook replica"
    ALONE = "alone"

    @property
    def notebook(self) -> bool:
        """Whether this process is part of an interactive session (its replica 0 or another)."""
        return self in (JobMode.NOTEBOOK_SESSION, JobMode.NOTEBOOK_REPLICA)


@dataclass(frozen=True)
class ProcessRole:
    """This process's mode, identity and launcher.

    Attributes:
        mode: how it runs.
        env: its identity among the job's replicas (None when alone).
        launcher: what started this process's local replicas and watches them, where this process
            did (replica 0 of a self-launched job, of a notebook session), or the session a
            notebook replica serves; None where someone else started them.
    """

    mode: JobMode
    env: ReplicaEnv | None = None
    launcher: Launcher | Any | None = None

    @property
    def rank(self) -> int:
        """Its replica index in the job (0 when alone)."""
        return self.env.rank if self.env is not None else 0

    @property
    def world_size(self) -> int:
        """How many replica processes the job has (1 when alone)."""
        return self.env.world_size if self.env is not None else 1


_recorded: ProcessRole | None = None  # what a launcher made of this process; None: read the environment
_lock = threading.Lock()


def current() -> ProcessRole:
    """This process's :class:`ProcessRole`: the one a launcher recorded, else the environment's."""
    recorded = _recorded
    if recorded is not None:
        return recorded
    env = job_env()
    if env is None:
        return ProcessRole(JobMode.ALONE)
    job = self_launch.current_job()
    if job is not None and env is job.env:  # replica 0 of the replicas this program started
        return ProcessRole(JobMode.EMBEDDED_HOST if job.embedded else JobMode.SELF_LAUNCHED, env, job)
    return ProcessRole(JobMode.ENVIRONMENT, env)


def record(mode: JobMode, env: ReplicaEnv, launcher: Any) -> ProcessRole:
    """A notebook session says what this process has become (it started, or joined, replicas)."""
    global _recorded
    with _lock:
        _recorded = ProcessRole(mode, env, launcher)
        return _recorded


def forget(launcher: Any) -> None:
    """``launcher``'s session has ended here: the process's mode is read from the environment
    again. A launcher that is not the recorded one changes nothing."""
    global _recorded
    with _lock:
        if _recorded is not None and _recorded.launcher is launcher:
            _recorded = None


def ipython_shell() -> Any:
    """The running IPython shell (kernel or terminal), or None."""
    module = sys.modules.get("IPython")
    return module.get_ipython() if module is not None else None


def interactive_mode() -> str | None:
    """How this interpreter runs user code: "ipython", "repl", "program" (-c, stdin), or None (a script).

    None too for Python embedded in another program (R through reticulate): forking that program
    would share its input and its exit clean-up, so its replicas are started as fresh copies of
    the host program instead (:mod:`phalanx.launch.host`).
    """
    if ipython_shell() is not None:
        return "ipython"
    if host.embedded():
        return None
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script and os.path.exists(script):
        return None
    return "repl" if hasattr(sys, "ps1") else "program"


def starting_mode() -> JobMode:
    """The mode this process would run in if it started replicas now (it runs ``ALONE``)."""
    if interactive_mode() is not None:  # a notebook, the REPL, -c, stdin: no script to start again
        return JobMode.NOTEBOOK_SESSION
    return JobMode.EMBEDDED_HOST if host.embedded() else JobMode.SELF_LAUNCHED
