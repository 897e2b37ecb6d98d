"""The stack-dump signal is a setting (``PHALANX_STACK_SIGNAL``, default SIGUSR2), not SIGUSR1.

Slurm sends SIGUSR1 before a job's time runs out (``--signal=USR1@60``), for the program to save and
requeue; a replica whose SIGUSR1 printed its stacks could never take that signal. Every place that
installs the dump (a launched replica, a parameter-server task) or sends it (the supervisor's dump of
a lingering task, the test harness's dump of a hung job) uses the setting; SIGUSR1 is left alone.
"""

from __future__ import annotations

import io
import signal
import sys
import time
from pathlib import Path

import pytest

from phalanx.config import Settings, stack_signal
from phalanx.errors import ClusterSpecError
from phalanx.launch.root_cause import Task
from phalanx.launch.supervisor import Supervisor

from conftest import PRELUDE, run_job


def test_the_default_is_sigusr2_and_a_name_or_number_is_taken():
    assert Settings.from_environ({}).stack_signal == "SIGUSR2"
    for raw in ("SIGUSR1", "USR1", "usr1", str(int(signal.SIGUSR1))):
        assert Settings.from_environ({"PHALANX_STACK_SIGNAL": raw}).stack_signal == "SIGUSR1", raw
    assert stack_signal({"PHALANX_STACK_SIGNAL": "SIGWINCH"}) == signal.SIGWINCH
    assert stack_signal({}) == signal.SIGUSR2


@pytest.mark.parametrize("raw", ["SIGKILL", "SIGSTOP", "SIGTERM", "SIGINT", "SIGSEGV", "nope", "0", "999"])
def test_a_signal_that_cannot_carry_a_dump_is_refused_naming_the_setting(raw):
    with pytest.raises(ClusterSpecError, match="PHALANX_STACK_SIGNAL") as info:
        Settings.from_environ({"PHALANX_STACK_SIGNAL": raw})
    assert repr(raw) in str(info.value) and "HINT" in str(info.value)


# A launched task that installs phalanx's replica hooks (no torch: it starts in milliseconds), then
# says which signals it catches and lingers in a function the dump must name.
_TASK = """
import sys, time
from pathlib import Path
from phalanx.launch import replica_hooks
replica_hooks.install()
caught = int([l for l in open("/proc/self/status") if l.startswith("SigCgt:")][0].split()[1], 16)
Path(sys.argv[1]).write_text(" ".join(str(s) for s in range(1, 65) if caught >> (s - 1) & 1))
def lingering_in_user_code():
    while True:
        time.sleep(0.05)
lingering_in_user_code()
"""


def _caught(path: Path) -> set[int]:
    deadline = time.monotonic() + 30
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, "the task never said which signals it catches"
        time.sleep(0.02)
    return {int(s) for s in path.read_text().split()}


@pytest.mark.parametrize("setting", [None, "SIGUSR1", "SIGWINCH"])
def test_a_launched_replica_dumps_its_stack_on_the_setting_and_leaves_sigusr1_alone(tmp_path, monkeypatch, setting):
    if setting is not None:
        monkeypatch.setenv("PHALANX_STACK_SIGNAL", setting)
    expected = signal.Signals[setting or "SIGUSR2"]
    sup = Supervisor(out=io.StringIO())
    said = tmp_path / "caught"
    run = sup.start(
        Task(
            name="replica 1",
            command=(sys.executable, "-c", _TASK, str(said)),
            log_path=str(tmp_path / "replica_1.log"),
        )
    )
    try:
        caught = _caught(said)
        assert expected in caught, caught
        if expected != signal.SIGUSR1:
            assert signal.SIGUSR1 not in caught, "SIGUSR1 must stay free for the program (Slurm's requeue signal)"
        stacks = sup.dump_stacks([run], settle=0.5)
    finally:
        sup.kill()
    assert "lingering_in_user_code" in stacks["replica 1"], stacks


def test_a_hung_test_job_dumps_its_stacks_on_the_setting(tmp_path):
    """conftest's hard timeout: the replica scripts' prelude and the harness agree on the signal."""
    program = tmp_path / "hung.py"
    program.write_text(PRELUDE + "import time\ndef hung_in_user_code():\n    time.sleep(60)\nhung_in_user_code()\n")
    with pytest.raises(pytest.fail.Exception, match="hung_in_user_code"):
        run_job([sys.executable, str(program)], timeout=3, cwd=tmp_path, fresh=True)
