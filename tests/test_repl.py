"""Multi-replica strategies from the Python REPL (through a pseudo-terminal), IPython's terminal,
``python -c`` and ``python -`` (stdin): statement by statement, or the whole input at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pexpect = pytest.importorskip("pexpect")

LINES = [
    "import phalanx, torch",
    "s = phalanx.MirroredStrategy(['cpu:0', 'cpu:1'])",
    "r = phalanx.interactive.replica_id()",
    "x = s.reduce('sum', s.run(lambda: torch.tensor([float(r + 1)])), axis=None)",
    "open(os.path.join(OUT, f'replica_{r}'), 'w').write(str(x.item()))",
    "print('RESULT', x.item())",
]
PROGRAM = "import os\nOUT = %r\n" + "\n".join(LINES) + "\n"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "PHALANX_LOG_ROOT": str(tmp_path / "logs"), "OMP_NUM_THREADS": "1", "TERM": "dumb"}
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _recorded(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in out.iterdir()}


def _children_gone(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if not psutil.Process(pid).children(recursive=True):
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError("replica processes left behind")


@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_program_mode(tmp_path, how):
    out = tmp_path / "out"
    out.mkdir()
    program = PROGRAM % str(out)
    cmd = [sys.executable, "-c", program] if how == "-c" else [sys.executable, "-"]
    res = subprocess.run(
        cmd,
        input=program if how == "stdin" else None,
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("RESULT 3.0") == 1  # replica 1's print went to its log
    assert _recorded(out) == {"replica_0": "3.0", "replica_1": "3.0"}


def test_program_mode_failing_replica_fails_the_program(tmp_path):
    program = PROGRAM % str(tmp_path) + "if r == 1:\n    raise ValueError('only on replica 1')\n"
    res = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=_env(tmp_path), timeout=120, cwd=tmp_path
    )
    assert res.returncode != 0
    assert "replica 1" in res.stderr and "only on replica 1" in res.stderr


@pytest.mark.parametrize("shell", ["python", "ipython"])
def test_terminal_repl(tmp_path, shell):
    out = tmp_path / "out"
    out.mkdir()
    if shell == "python":
        child = pexpect.spawn(
            sys.executable, ["-q", "-i"], env=_env(tmp_path), cwd=str(tmp_path), encoding="utf-8", timeout=90
        )
        prompt = ">>> "
    else:
        pytest.importorskip("IPython")
        child = pexpect.spawn(
            sys.executable,
            [
                "-m",
                "IPython",
                "--simple-prompt",
                "--no-banner",
                "--colors=nocolor",  # lowercase: IPython 9's theme name, and IPython 8 ignores case
                "--HistoryManager.enabled=False",
                "--TerminalInteractiveShell.confirm_exit=False",
            ],
            env=_env(tmp_path),
            cwd=str(tmp_path),
            encoding="utf-8",
            timeout=90,
        )
        prompt = r"In \[\d+\]: "
    try:
        child.expect(prompt)
        for line in ["import os", f"OUT = {str(out)!r}", *LINES]:
            child.sendline(line)
            child.expect(prompt)
        assert "RESULT 3.0" in child.before
        assert _recorded(out) == {"replica_0": "3.0", "replica_1": "3.0"}
        child.sendline("if r == 1: raise ValueError('only on replica 1')")
        if shell == "python":
            child.sendline("")  # ends the compound statement
        child.expect(prompt)
        assert "ReplicaCellError" in child.before and "only on replica 1" in child.before
        child.sendline("print('NEXT', s.reduce('sum', s.run(lambda: torch.ones(1)), axis=None).item())")
        child.expect(prompt)
        assert "NEXT 2.0" in child.before
        pid = child.pid
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    _children_gone(pid)


def test_a_replica_shell_shows_plain_uncoloured_tracebacks(tmp_path):
    """quiet_shell on the installed IPython (8 in CI's oldest job, 9 in its newest): a replica's log
    gets plain tracebacks without colour codes, through IPython's public magics, with no deprecated
    call from phalanx (IPython 9 deprecated ``set_colors`` and renamed "NoColor" to "nocolor")."""
    pytest.importorskip("IPython")
    program = (
        "import warnings\n"
        "warnings.filterwarnings('error', category=DeprecationWarning, module='phalanx')\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "from phalanx.interactive.replica import quiet_shell\n"
        "shell = InteractiveShell.instance(colors='linux')\n"
        "quiet_shell(shell)\n"
        "shell.run_cell('def f():\\n    raise ValueError(\"in a replica\")\\nf()')\n"
        "print('MODE', shell.InteractiveTB.mode)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=_env(tmp_path), timeout=60, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert "MODE Plain" in res.stdout, res.stdout
    assert "ValueError: in a replica" in res.stderr, res.stderr
    assert "\x1b[" not in res.stderr, repr(res.stderr)
