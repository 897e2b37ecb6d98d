"""The packing policy of phalanx.comm.core_packing, alone and wired to shared words (issue 33).

The multi-process test, replicas packed beside real busy processes, is in test_shm_allreduce.py.
Here the readings the policy takes from /proc are fed in, so every branch runs on a quiet or a busy
machine alike.
"""

from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest

from phalanx.comm import core_packing
from phalanx.comm.core_packing import SPREAD, Placement, decide

W = 0.25  # a window


@pytest.mark.parametrize(
    "run, runnable, packed",
    [
        ([0.05, 0.06], [0.15, 0.16], True),  # each ran a fifth, waiting for a core the rest: crowded
        ([0.23, 0.22], [0.0, 0.01], False),  # an idle host
        ([0.05, 0.05], [0.01, 0.0], False),  # idle, asleep (input, a slow peer): not the host's doing
        ([0.1, 0.1], [0.14, 0.14], True),  # 0.8 of a core between them: one core of their own is more
        ([0.12, 0.12], [0.12, 0.12], False),  # ~a core between them: packing would gain nothing
        ([0.2, 0.2], [0.1, 0.1], False),  # 1.6 cores between them: more than one core would give
        ([0.05, 0.2], [0.2, 0.0], False),  # only one of them is crowded
    ],
)
def test_spread_replicas_pack_only_when_the_host_takes_their_cores(run, runnable, packed):
    assert decide(False, run, runnable, 0.0, W, 0) == (packed, 0)


def test_packed_replicas_spread_after_consecutive_calm_windows_only():
    assert decide(True, [0.1, 0.1], [0.1, 0.1], 0.2, W, 0) == (True, 1)  # one calm window: wait
    assert decide(True, [0.1, 0.1], [0.1, 0.1], 0.2, W, 1) == (False, 0)  # two in a row: spread
    assert decide(True, [0.1, 0.1], [0.1, 0.1], 0.05, W, 1) == (True, 0)  # busy again: start over
    assert decide(True, [], [], 0.2, W, 1) == (True, 1)  # nothing measured: no change
    assert decide(False, [0.0], [0.3], 0.0, 0.0, 0) == (False, 0)  # an empty window: no change


class _Shared(list):
    """Stands in for the process's one owner slot: here two ranks live in one process."""

    def __getitem__(self, i):
        return None

    def __setitem__(self, i, value):
        pass


class _Host:
    """Two ranks' shared words (a list stands in for the segment) and the /proc readings."""

    CHOICE, SLOTS = 0, [(1, 2), (3, 4)]

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.words = [0] * 5
        self.times = [(0, 0), (0, 0)]  # each rank's (run, runnable) ns, as schedstat gives them
        self.idle = 0.0  # seconds the other cores have been idle
        self.rank, self.now = 0, 100.0
        monkeypatch.setattr(core_packing, "_OWNER", _Shared([None]))
        monkeypatch.setattr(core_packing, "_clock", lambda: self.now)
        monkeypatch.setattr(core_packing, "_schedstat", lambda: self.times[self.rank])
        monkeypatch.setattr(core_packing, "_idle_s", lambda cores: self.idle)
        monkeypatch.setattr(core_packing, "_current_core", lambda: 1)
        monkeypatch.setattr(core_packing, "_free_descendants", lambda core, mask, replicas=(): None)
        moved: list[set[int]] = []
        monkeypatch.setattr(core_packing, "_set_threads", moved.append)
        self.moved = moved

    def window(self, leader: Placement, peer: Placement, run: float, runnable: float, idle: float = 0.0) -> None:
        """A window passes: each rank ran ``run`` s and waited ``runnable`` s; the other cores idled ``idle`` s."""
        self.times = [(r + int(run * 1e9), w + int(runnable * 1e9)) for r, w in self.times]
        self.idle += idle
        self.now += W
        for rank, p in ((1, peer), (0, leader)):
            self.rank = rank
            p._next = 0.0  # the window is over
            if p.publish(self.words, self.SLOTS[rank]) and p.leader:
                p.decide(self.words, self.SLOTS, self.CHOICE)
        for p in (leader, peer):
            p.follow(self.words[self.CHOICE] - 1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="packing needs two cores")
def test_the_leaders_choice_moves_both_ranks_and_a_calm_host_spreads_them_again(monkeypatch):
    host = _Host(monkeypatch)
    leader, peer = Placement(True, 2, window_s=W), Placement(False, 2, window_s=W)
    mask = leader.mask
    host.window(leader, peer, 0.05, 0.18)  # the first publication: no window to judge yet
    host.window(leader, peer, 0.05, 0.18)
    assert host.words[host.CHOICE] == 1 + 1  # core 1, where the leader runs
    assert (leader.core, peer.core) == (1, 1) and host.moved == [{1}, {1}]
    assert leader.packs == peer.packs == 1
    host.window(leader, peer, 0.12, 0.12)  # the first window packed only starts the count
    host.window(leader, peer, 0.12, 0.12, idle=0.01)  # the other core is busy: stay
    host.window(leader, peer, 0.12, 0.12, idle=0.2)
    assert (leader.core, peer.core) == (1, 1)
    host.window(leader, peer, 0.12, 0.12, idle=0.2)  # the second calm window in a row
    assert host.words[host.CHOICE] == 0 and (leader.core, peer.core) == (SPREAD, SPREAD)
    assert host.moved[2:] == [mask, mask]
    assert leader.packed_s > 0


def test_packing_off_or_one_core_never_moves_a_thread(monkeypatch):
    host = _Host(monkeypatch)
    for leader, peer in [
        (Placement(True, 2, enabled=False, window_s=W), Placement(False, 2, enabled=False, window_s=W)),
        (Placement(True, 1, window_s=W), Placement(False, 1, window_s=W)),  # one replica: nothing to pack
    ]:
        for _ in range(3):
            host.window(leader, peer, 0.05, 0.18)
        assert host.words[host.CHOICE] == 0 and host.moved == []


def test_packing_is_a_setting_with_a_typed_error(monkeypatch):
    from phalanx.config import Settings
    from phalanx.errors import ClusterSpecError

    assert Settings.from_environ({}).shm_packing is True
    assert Settings.from_environ({"PHALANX_SHM_PACKING": "0"}).shm_packing is False
    with pytest.raises(ClusterSpecError, match="PHALANX_SHM_PACKING"):
        Settings.from_environ({"PHALANX_SHM_PACKING": "off"})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="packing needs two cores")
def test_one_placement_per_process_moves_its_threads(monkeypatch):
    monkeypatch.setattr(core_packing, "_OWNER", [None])
    first, second = Placement(True, 2), Placement(True, 2)
    assert first.enabled and not second.enabled  # two leaders would take turns moving the threads
    first.restore()
    assert not first.enabled and Placement(True, 2).enabled  # the slot is free again after close


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="packing needs two cores")
def test_a_process_started_while_packed_gets_the_original_mask_back(monkeypatch):
    """subprocess, spawn and forkserver do not run the fork hook: the kernel hands them the packed
    mask, and the rank gives it back to them and to their own children at its next window, and
    when it spreads."""
    monkeypatch.setattr(core_packing, "_OWNER", [None])
    # A peer replica that is this rank's child (a self-launched job's replica 1), packed by itself.
    peer = subprocess.Popen(["sleep", "60"], start_new_session=True)
    started: list[subprocess.Popen] = [peer]
    here = Placement(True, 2, window_s=0.0, pids=[os.getpid(), peer.pid])
    mask, core = set(here.mask), min(here.mask)
    os.sched_setaffinity(peer.pid, {core})
    words = [0] * 3
    here.follow(core)
    try:
        assert os.sched_getaffinity(0) == {core}
        started.append(subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True))
        shell = psutil.Process(started[-1].pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not shell.children():
            time.sleep(0.05)
        family = [shell.pid] + [c.pid for c in shell.children()]
        assert len(family) == 2, family  # the shell and its sleep
        assert all(os.sched_getaffinity(pid) == {core} for pid in family)  # what the kernel gave them
        assert here.publish(words, (1, 2))  # a window has passed (window_s=0)
        assert all(os.sched_getaffinity(pid) == mask for pid in family)
        assert os.sched_getaffinity(peer.pid) == {core}  # the peer follows the leader itself
        started.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
        assert os.sched_getaffinity(started[-1].pid) == {core}
        here.follow(SPREAD)  # spreading frees them at once
        assert os.sched_getaffinity(started[-1].pid) == mask and os.sched_getaffinity(0) == mask
        assert os.sched_getaffinity(peer.pid) == {core}
    finally:
        here.restore()
        for p in started:
            os.killpg(p.pid, 9)
            p.wait()
    assert os.sched_getaffinity(0) == mask


def test_the_proc_readers_read_this_host():
    run, runnable = core_packing._schedstat()
    assert run > 0 and runnable >= 0  # this thread has run
    assert core_packing._current_core() in os.sched_getaffinity(0)
    assert core_packing._idle_s(sorted(os.sched_getaffinity(0))) > 0  # the cores idled at some point since boot
