"""Whether the peers of a job are alive: a heartbeat in the store, and ``/proc`` for same-host peers.

Used after a collective fails, to name the peer that caused it (dead, stopped or silent), and by
the shared-memory all-reduce (:mod:`phalanx.comm.shm`) to notice a dead peer while it waits.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from phalanx._signal_routing import helper_threads_ignore_stop_signals

HEARTBEAT_INTERVAL = 0.25  # seconds; a peer whose counter stops for 4 intervals is unresponsive


def process_state(pid: int) -> str:
    """'R'/'S'/... from /proc, 'Z' for a zombie, 'T' when stopped, '' when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def start_time(pid: int) -> str:
    """Returns a process's start time (clock ticks since boot), "" where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def alive(pid: int, start: str) -> bool:
    """Whether a process is still running; a zombie or a reused pid counts as dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0] not in (b"Z", b"X", b"x") and (not start or fields[19].decode() == start)
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class Heartbeat:
    """A daemon thread that bumps ``hb/<rank>`` in the store every ``interval`` seconds.

    It shares the communicator's store client (its operations are serialised) rather than owning
    one: a C++ client still connecting or waiting inside this thread when the interpreter exits
    was seen to abort the process ("terminate called ...").

    Args:
        on_beat: called with the store at every beat, also once the store is gone (the snapshot
            agent of :mod:`phalanx.comm.snapshot`, which answers the run directory's requests too).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        interval: float = HEARTBEAT_INTERVAL,
        on_beat: Callable[[Any], None] | None = None,
    ) -> None:
        self._store, self._rank, self._interval = store, rank, interval
        self._on_beat = on_beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="phalanx-heartbeat", daemon=True)
        with helper_threads_ignore_stop_signals():  # a Ctrl-C must wake the main thread, not this one
            self._thread.start()

    def _beat(self) -> None:
        count = 0
        beating = True
        while not self._stop.wait(self._interval):
            count += 1
            if beating:
                try:
                    self._store.set(f"hb/{self._rank}", str(count))
                except Exception:  # noqa: BLE001 - the store is gone: the job is ending or rank 0 died
                    beating = False
            if self._on_beat is not None:
                try:
                    self._on_beat(self._store)
                except Exception:  # noqa: BLE001 - answering a diagnosis never ends the heartbeat
                    pass
            elif not beating:
                return

    def stop(self, timeout: float = 6.0) -> None:
        """Stops the thread; waits for it (it may be inside a store call with a 5 s timeout)."""
        self._stop.set()
        self._thread.join(timeout=timeout)


def unresponsive_peers(
    peers: dict[int, dict[str, Any]],
    rank: int,
    host: str,
    master: tuple[str, int],
    world_size: int,
    interval: float = HEARTBEAT_INTERVAL,
    *,
    prefix: str = "",
) -> list[int]:
    """Ranks that are dead or stopped: /proc for peers on this host, heartbeats for the rest.

    Args:
        peers: rank -> ``{"host": ..., "pid": ...}`` as exchanged at rendezvous.
        rank: this process's rank (never a suspect).
        host: this process's host id.
        master: the store's address, for a fresh client (the communicator's may be broken).
        world_size: the job's size.
        interval: the heartbeat interval.
        prefix: the communicator's keys' prefix in that store (a shared store, a later strategy's).
    """
    local = [r for r, info in peers.items() if r != rank and info["host"] == host]
    remote = [r for r in peers if r != rank and r not in local]
    suspects: list[int] = []
    # A peer whose socket just closed may still be exiting; give it a moment to be gone.
    deadline = time.monotonic() + 1.0
    while local and not suspects and time.monotonic() < deadline:
        suspects = [r for r in local if process_state(peers[r]["pid"]) in ("", "Z", "X", "T", "t")]
        if not suspects:
            time.sleep(0.02)
    if remote:
        try:
            client = dist.TCPStore(
                master[0], master[1], world_size, False, datetime.timedelta(seconds=2), wait_for_workers=False
            )
            if prefix:
                client = dist.PrefixStore(prefix, client)

            def beats() -> dict[int, bytes]:
                return {r: client.get(f"hb/{r}") if client.check([f"hb/{r}"]) else b"" for r in remote}

            before = beats()
            time.sleep(4 * interval)
            after = beats()
            suspects += [r for r in remote if after[r] == before[r]]
        except Exception:  # noqa: BLE001 - the store lives in rank 0's process
            suspects.append(0)
    return sorted(set(suspects))
