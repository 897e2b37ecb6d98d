"""Run directories: where one run's logs and error files go, whose they are, and which are kept.

``LOGDIR/<run-id>/`` (:class:`RunDirectory`) holds ``<task>.log``, ``<task>.error.json`` (torch
elastic's error-file format) and ``.<task>.done``; the log root is ``PHALANX_LOG_ROOT`` (default
``$TMPDIR/phalanx-logs``, :func:`phalanx.launch.settings.log_root`). A run directory names its
owner (user, host, program): ``PHALANX_KEEP_RUNS`` are kept per owner, so one program's runs never
prune another's, and a directory whose supervisor still runs is never deleted.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Sequence

from phalanx.launch import settings

__all__ = ["RunDirectory", "new_run_id", "prune_runs", "run_owner", "tail"]

_RUN_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")
_MARKER = ".supervisor"  # in a run directory: the pid of the supervisor that writes there
_OWNER = ".owner"  # in a run directory: whose it is (run_owner); only its owner's runs prune it


def new_run_id() -> str:
    """A run id that sorts by start time: ``20260101-120000-1a2b3c``."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        return f"uid{os.getuid()}"


def run_owner(command: Sequence[str]) -> str:
    """Whose runs a run directory counts among: ``user@host program``.

    The program is a script's absolute path (``phalanx run``'s command has no interpreter, and may
    name it relatively; self-launch's starts with ``sys.executable``), ``-m module``, or the first
    words of another command (an R host's). The host tells apart machines that share a log root
    on a network file system.

    Example:
        >>> run_owner(["python3", "-m", "trainer.main", "--epochs", "3"]).endswith(" -m trainer.main")
        True
    """
    args = [str(a) for a in command]
    if len(args) > 1 and (args[0] == sys.executable or os.path.basename(args[0]).startswith("python")):
        args = args[1:]
    if not args:
        program = "?"
    elif args[0] in ("-m", "-c") and len(args) > 1:
        program = f"{args[0]} {args[1]}" if args[0] == "-m" else "-c"
    elif args[0].startswith("-"):
        program = " ".join(args[:3])
    else:
        program = os.path.abspath(args[0])
    return f"{_user()}@{socket.gethostname()} {program}"


def prune_runs(root: str, keep: int, *, current: str | None = None, owner: str | None = None) -> list[str]:
    """Deletes the oldest run directories under ``root`` so that ``keep`` remain; returns them.

    Only directories named like a run id are touched, never one whose supervisor still runs. With
    ``owner`` (:func:`run_owner`), only that owner's runs count and are deleted: another program's,
    another user's or host's, and a run that names no owner are never touched.
    """
    try:
        names = sorted(n for n in os.listdir(root) if _RUN_ID.match(n) and os.path.isdir(os.path.join(root, n)))
    except OSError:
        return []
    if owner is not None:
        names = [n for n in names if n == current or _owner_of(os.path.join(root, n)) == owner]
    removed = []
    for name in names[: max(0, len(names) - keep)]:
        path = os.path.join(root, name)
        if name == current:
            continue
        try:
            with open(os.path.join(path, _MARKER)) as f:
                if _pid_alive(int(f.read().strip() or 0)):
                    continue
        except (OSError, ValueError):
            pass
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _owner_of(path: str) -> str | None:
    try:
        with open(os.path.join(path, _OWNER)) as f:
            return f.read()
    except OSError:
        return None


class RunDirectory:
    """``LOGDIR/<run-id>/``: one run's logs (``<task>.log``) and error files (``<task>.error.json``).

    Args:
        root: the log root; default :func:`phalanx.launch.settings.log_root`.
        run_id: default a fresh :func:`new_run_id`.
        program: the command the run runs, whose owner (:func:`run_owner`) the run is written as;
            the runs kept are counted per owner.
    """

    def __init__(self, root: str | None = None, run_id: str | None = None, *, program: Sequence[str] = ()) -> None:
        self.root = os.path.abspath(root or settings.log_root())
        self.run_id = run_id or new_run_id()
        self.path = os.path.join(self.root, self.run_id)
        self.owner = run_owner(program)

    def create(self) -> RunDirectory:
        """Creates the directory and prunes its owner's oldest ones (``PHALANX_KEEP_RUNS`` are kept
        per user, host and program: another job's never count, and are never deleted)."""
        keep = settings.keep_runs()
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, _MARKER), "w") as f:
            f.write(str(os.getpid()))
        with open(os.path.join(self.path, _OWNER), "w") as f:
            f.write(self.owner)
        prune_runs(self.root, keep, current=self.run_id, owner=self.owner)
        return self

    def log_path(self, stem: str) -> str:
        return os.path.join(self.path, f"{stem}.log")

    def error_path(self, stem: str) -> str:
        return os.path.join(self.path, f"{stem}.error.json")

    def done_path(self, stem: str) -> str:
        return os.path.join(self.path, f".{stem}.done")


def tail(path: str | None, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read()
    except OSError:
        return ""
    # A progress bar rewrites its line with carriage returns: keep what the line showed last.
    text = [line.rsplit(b"\r", 1)[-1] if line.rstrip(b"\r") else line for line in data.splitlines()]
    return b"\n".join(text[-lines:]).decode(errors="replace")
