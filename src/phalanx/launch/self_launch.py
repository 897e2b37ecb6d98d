"""``python train.py`` with a multi-replica strategy: the script starts its other replicas itself.

The process the user started becomes replica 0. It runs the same command again for replicas
1..N-1 with their identity in the environment (:class:`~phalanx.launch.env.ReplicaEnv`), sends
their output to per-replica log files, and watches them: if one fails, the others are stopped and
its log's tail is printed as the root cause. Children die with the parent (``PR_SET_PDEATHSIG``),
so an interrupted job leaves no process behind.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from phalanx.errors import LaunchError
from phalanx.launch.env import ReplicaEnv, free_port

_GRACE = 5.0  # seconds the main thread gets to raise its own error after a replica died


def _die_with_parent() -> None:
    # prctl(PR_SET_PDEATHSIG, SIGKILL): the kernel kills the child when its parent exits.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def _script_command() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if os.environ.get("PYTEST_CURRENT_TEST"):
        raise LaunchError("A multi-replica strategy cannot start its replicas from inside pytest.",
                          hint="run the training code as a script (python train.py) or with "
                               "`phalanx run -n N train.py`")
    if spec is not None and spec.name and spec.name != "__main__":
        return [sys.executable, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    script = getattr(main, "__file__", None)
    if not script or not os.path.exists(script):
        raise LaunchError("A multi-replica strategy needs a script to start its replicas from; this "
                          "interpreter runs no script file (interactive or `python -c`).",
                          hint="save the code to train.py and run `python train.py` or "
                               "`phalanx run -n N train.py`")
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


def default_log_dir(run_id: str) -> str:
    base = os.environ.get("PHALANX_LOG_ROOT") or os.path.join(tempfile.gettempdir(), "phalanx-logs")
    return os.path.join(base, run_id)


class ReplicaLauncher:
    """Starts and supervises replicas 1..N-1 of the current script; this process is replica 0."""

    def __init__(self, world_size: int, quiet: bool = False) -> None:
        self.command = _script_command()
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.log_dir = default_log_dir(self.run_id)
        os.makedirs(self.log_dir, exist_ok=True)
        self.env = ReplicaEnv(rank=0, world_size=world_size, local_rank=0, local_world_size=world_size,
                              master_addr="127.0.0.1", master_port=free_port(), run_id=self.run_id,
                              log_dir=self.log_dir)
        self.children: dict[int, subprocess.Popen] = {}
        self._stopping = threading.Event()
        self._reported = False
        for rank in range(1, world_size):
            child_env = dict(os.environ)
            child_env.update(ReplicaEnv(**{**self.env.__dict__, "rank": rank, "local_rank": rank}).to_environ())
            child_env["PYTHONUNBUFFERED"] = "1"
            log = open(self.log_path(rank), "wb")  # noqa: SIM115 - the child owns it from here
            try:
                self.children[rank] = subprocess.Popen(self.command, env=child_env, stdout=log,
                                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                       preexec_fn=_die_with_parent)
            finally:
                log.close()
        if not quiet:
            print(f"phalanx: started replicas 1..{world_size - 1}; their output is in {self.log_dir}",
                  file=sys.stderr, flush=True)
        atexit.register(self.finish)
        self._watcher = threading.Thread(target=self._watch, name="phalanx-replica-watcher", daemon=True)
        self._watcher.start()

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"replica_{rank}.log")

    def _tail(self, rank: int, lines: int = 15) -> str:
        try:
            with open(self.log_path(rank), "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def _report(self, rank: int, code: int) -> None:
        if self._reported:
            return
        self._reported = True
        print(f"\nphalanx: root cause (first failure): replica {rank} (pid {self.children[rank].pid}) "
              f"exited with code {code}. Last lines of {self.log_path(rank)}:\n{self._tail(rank)}\n",
              file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while not self._stopping.wait(0.1):
            for rank, proc in self.children.items():
                code = proc.poll()
                if code not in (None, 0):
                    self._report(rank, code)
                    self._terminate()
                    # The main thread usually fails on its own at the next collective; if it is
                    # blocked somewhere that cannot notice, end the process so the job never hangs.
                    if not self._stopping.wait(_GRACE):
                        print("phalanx: replica 0 is stopping because a peer failed", file=sys.stderr, flush=True)
                        os._exit(1)
                    return

    def _terminate(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 3
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def finish(self, timeout: float = 60.0) -> None:
        """At exit: waits for the replicas to end; a failed replica makes this process fail too."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        deadline = time.monotonic() + timeout
        failed = None
        for rank, proc in self.children.items():
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            if code not in (0, None) and failed is None:
                failed = (rank, code)
        self._terminate()
        if failed is not None:
            self._report(*failed)
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)
