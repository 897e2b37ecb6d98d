"""What one replica says about itself when asked, and how it is asked.

A *snapshot* is a JSON-able dict: the replica's identity, its step, its flight recorder's last
collectives (:mod:`phalanx.comm.flight_recorder`), its main thread's live Python stack (each frame
marked as the user's or not), the share of a core that thread used a moment ago and the share of
that moment it was running or waiting for a core (busy, on a crowded host), its state, and
what it declared it does alone (``phalanx.wait_for_chief``). :mod:`phalanx.comm.diagnosis` puts the
replicas' snapshots side by side.

Every replica's :class:`Agent` answers from the heartbeat thread the communicator already runs (it
wakes every 0.25 s), so a replica whose main thread is asleep, reading a pipe, running its own
Python or blocked in a collective still answers. Two ways to ask:

* **The job's store** (every launcher, every host, ``TF_CONFIG`` jobs too): :func:`ask` adds 1 to
  ``diag/req``; each agent sees the counter move at its next beat and sets ``diag/snap/<rank>``.
  The replica whose collective failed asks this way before it raises.
* **The run directory** (jobs a phalanx launcher started, whatever state their store is in):
  ``<run>/diagnosis/request`` holds a token; each agent that sees it change writes
  ``<run>/diagnosis/replica_<rank>.json``. ``phalanx diagnose --live`` asks this way.

Polling costs one store round trip and one ``stat`` per beat; a snapshot is built only when asked.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx._compat.python import main_thread_frame
from phalanx.comm.flight_recorder import FlightRecorder, library_frame

__all__ = ["Agent", "ask", "ask_directory", "final", "leave_final", "take"]

REQUEST_KEY, SNAPSHOT_KEY = "diag/req", "diag/snap/"
DIRECTORY = "diagnosis"  # under the run directory
REQUEST_FILE = "request"
CPU_WINDOW = 0.2  # seconds over which a snapshot measures its main thread's CPU share
_NOT_USER = tuple(
    {
        os.path.realpath(p) + os.sep
        for p in (
            sysconfig.get_paths()["stdlib"],
            sysconfig.get_paths()["platstdlib"],
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # phalanx's package
        )
    }
)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _user(frame: Any) -> bool:
    """Whether a frame is the user's: not phalanx's, torch's or Keras', not the standard library's
    (nor phalanx's own ``__main__``: the fork server that a forked replica's stack starts in)."""
    if library_frame(frame):
        return False
    path = frame.f_code.co_filename
    return not (path.startswith("<") or os.path.realpath(path).startswith(_NOT_USER))


def main_stack(limit: int = 40) -> list[dict[str, Any]]:
    """The main thread's live Python stack, outermost first (its innermost ``limit`` frames)."""
    import linecache

    frame = main_thread_frame()
    frames = []
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        frames.append(
            {
                "file": code.co_filename,
                "line": frame.f_lineno,
                "function": code.co_name,
                "text": linecache.getline(code.co_filename, frame.f_lineno).strip(),
                "user": _user(frame),
            }
        )
        frame = frame.f_back
    return frames[::-1]


def _thread_times(tid: int | None) -> tuple[float, float, str] | None:
    """A thread's seconds on a core and seconds runnable but waiting for one, and its state letter.

    From /proc: ``schedstat`` (nanoseconds, both counts) where the kernel keeps it, else ``stat``'s
    CPU ticks (no waiting count). None without /proc.
    """
    if tid is None:
        return None
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        state = fields[0].decode()
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on, waiting = (int(x) / 1e9 for x in f.read().split()[:2])
        except (OSError, ValueError):
            on, waiting = (int(fields[11]) + int(fields[12])) / _TICK, 0.0
        return on, waiting, state
    except (OSError, IndexError, ValueError):
        return None


def cpu_share(window: float = CPU_WINDOW) -> tuple[float | None, float | None, str]:
    """The main thread over the next ``window`` seconds: its share of a core, its share of the time
    it was running or runnable (on a crowded host a busy thread waits for a core: still busy), and
    its state letter at the end."""
    # The main thread is the thread group's leader: its id is the pid (a forked replica's
    # threading.main_thread().native_id may still be its fork server's).
    tid = os.getpid() if sys.platform.startswith("linux") else threading.main_thread().native_id
    before, start = _thread_times(tid), time.monotonic()
    if before is None:
        return None, None, ""
    time.sleep(window)
    after = _thread_times(tid)
    if after is None:
        return None, None, ""
    took = max(time.monotonic() - start, 1e-3)
    on = (after[0] - before[0]) / took
    return min(1.0, on), min(1.0, on + (after[1] - before[1]) / took), after[2]


def take(
    *,
    rank: int,
    world_size: int,
    name: str,
    recorder: FlightRecorder,
    step: int | None,
    timeout: float,
    host: str = "",
    request: int | str | None = None,
    sample_cpu: bool = True,
    waiting_for_chief: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """This replica's snapshot (see the module docstring); measuring its CPU share takes ``CPU_WINDOW``."""
    cpu, runnable, state = cpu_share() if sample_cpu else (None, None, "")
    return {
        "rank": rank,
        "world_size": world_size,
        "name": name,
        "pid": os.getpid(),
        "host": host,
        "time": time.time(),
        "step": step,
        "timeout": timeout,
        "collectives": recorder.to_json(),
        "stack": main_stack(),
        "cpu": cpu,
        "runnable": runnable,
        "state": state,
        "busy": recorder.busy,
        "waiting_for_chief": waiting_for_chief,
        "request": request,
    }


class Agent:
    """Answers snapshot requests for one communicator, from its heartbeat thread (:meth:`poll`).

    Args:
        snapshot: builds this replica's snapshot; called with ``request=`` the request's id.
        rank: this replica's rank.
        run_dir: the run directory a phalanx launcher made (''/None: requests come through the store only).
    """

    def __init__(self, snapshot: Callable[..., dict[str, Any]], rank: int, run_dir: str | None = None) -> None:
        self._snapshot, self._rank = snapshot, rank
        self._answered = 0
        self._store_ok = True
        self._dir = os.path.join(run_dir, DIRECTORY) if run_dir else None
        self._token: bytes | None = None
        self._seen: int | None = None

    def poll(self, store: Any) -> None:
        """Answers a request that arrived since the last call (the store's, then the run directory's)."""
        if self._store_ok:
            try:
                wanted = int(store.add(REQUEST_KEY, 0))
                if wanted > self._answered:
                    self._answered = wanted
                    store.set(f"{SNAPSHOT_KEY}{self._rank}", json.dumps(self._snapshot(request=wanted), default=str))
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 ended): the run directory still asks
                self._store_ok = False
        if self._dir is not None:
            self._answer_directory()

    def _answer_directory(self) -> None:
        path = os.path.join(self._dir, REQUEST_FILE)
        try:
            stamp = os.stat(path).st_mtime_ns
        except OSError:
            return
        if stamp == self._seen:
            return
        self._seen = stamp
        try:
            with open(path, "rb") as f:
                token = f.read().strip()
        except OSError:
            return
        if not token or token == self._token:
            return
        self._token = token
        answer = os.path.join(self._dir, f"replica_{self._rank}.json")
        temporary = f"{answer}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w") as f:
                json.dump(self._snapshot(request=token.decode(errors="replace")), f, default=str)
            os.replace(temporary, answer)
        except OSError:  # a diagnosis never fails a job
            pass


def ask(store: Any, ranks: list[int], wait: float) -> dict[int, dict[str, Any]]:
    """Asks the replicas ``ranks`` for their snapshots through the job's store; waits ``wait`` seconds at most.

    Returns:
        rank -> snapshot, for those that answered in time.
    """
    request = int(store.add(REQUEST_KEY, 1))
    deadline = time.monotonic() + wait
    found: dict[int, dict[str, Any]] = {}
    pending = list(ranks)
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            key = f"{SNAPSHOT_KEY}{r}"
            if not store.check([key]):
                continue
            try:
                snapshot = json.loads(store.get(key))
            except ValueError:
                continue
            if int(snapshot.get("request") or 0) >= request:
                found[r] = snapshot
                pending.remove(r)
        if pending:
            time.sleep(0.05)
    return found


def ask_directory(run_dir: str, wait: float) -> dict[int, dict[str, Any]]:
    """Asks the replicas that write to ``run_dir`` for their snapshots (``phalanx diagnose --live``).

    Waits until as many replicas as their snapshots say the job has have answered, or ``wait`` seconds.

    Returns:
        rank -> snapshot, for those that answered in time (replicas of this host, or of a shared disk).
    """
    directory = os.path.join(run_dir, DIRECTORY)
    os.makedirs(directory, exist_ok=True)
    token = f"{os.getpid()}-{time.time_ns()}"
    with open(os.path.join(directory, REQUEST_FILE), "w") as f:
        f.write(token)
    deadline = time.monotonic() + wait
    found: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        for name in os.listdir(directory):
            if not (name.startswith("replica_") and name.endswith(".json")):
                continue
            try:
                with open(os.path.join(directory, name)) as f:
                    snapshot = json.load(f)
            except (OSError, ValueError):
                continue
            if snapshot.get("request") == token:
                found[int(snapshot["rank"])] = snapshot
        sizes = {int(s.get("world_size") or 0) for s in found.values()}
        if found and len(found) >= max(sizes):
            break
        time.sleep(0.05)
    return found


def leave_final(run_dir: str, snapshot: dict[str, Any]) -> None:
    """Leaves a closing replica's last snapshot in the run directory (``final_<rank>.json``)."""
    directory = os.path.join(run_dir, DIRECTORY)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"final_{snapshot['rank']}.json")
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        json.dump(snapshot, f, default=str)
    os.replace(f"{path}.{os.getpid()}.tmp", path)


def final(run_dir: str, rank: int, pid: int) -> dict[str, Any] | None:
    """The last snapshot replica ``rank`` (process ``pid``) left when it closed, if it did."""
    try:
        with open(os.path.join(run_dir, DIRECTORY, f"final_{rank}.json")) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if found.get("pid") == pid else None
