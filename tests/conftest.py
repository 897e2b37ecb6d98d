"""Test harness: hygiene checks for every test and a hard-timeout runner for multi-process jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

# MLflow 3.x sends usage telemetry from a thread it starts at import, and notes its session in
# os.environ; the tests have no network and must leave no thread or variable behind.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# The scripts are programs the tests start (they train at import): never import them while
# collecting (pyproject's --doctest-modules would).
collect_ignore = ["scripts"]

# Prepended to every replica script: a stack dump on the stack-dump signal (PHALANX_STACK_SIGNAL,
# default SIGUSR2, which the hard timeouts below send), so a hung replica shows where it is.
PRELUDE = (
    "import faulthandler; from phalanx.config import stack_signal; "
    "faulthandler.register(stack_signal(), all_threads=True)\n"
)


def _stack_signal():
    """The signal the hung-job dumps send: the one replicas and the scripts' prelude register."""
    from phalanx.config import stack_signal

    return stack_signal()


# ----------------------------------------------------------------------------- starting jobs
# `python script.py` jobs are forked from per-test-process fork servers that imported torch (and,
# for scripts that import it, Keras) once: phalanx's own fork start (phalanx.launch.forkserver),
# which gives the program a fresh __main__, argv, environment, session and the interpreter's
# normal exit. Interpreter start-up was most of the suite's CPU time. PHALANX_TEST_FRESH=1 (or
# run_job(..., fresh=True)) starts every job as a fresh interpreter instead.
_FORK_SERVERS: dict[tuple[str, ...], object] = {}


def _fork_server_for(cmd: list[str], env: dict[str, str]):
    """The fork server to start ``cmd`` from, or None to start it fresh.

    ``python script.py`` and ``python -m phalanx.cli ...``: the launchers in both fork their
    replicas from the server they came from (forkserver.inherited_server), so a server that
    preloaded Keras is picked when a program of the job imports it.
    """
    if os.environ.get("PHALANX_TEST_FRESH") == "1" or len(cmd) < 2:
        return None
    from phalanx.launch.forkserver import forkable, preload_for

    if cmd[1].endswith(".py"):
        # run_programs.py imports nothing itself; the programs of its plan may import Keras
        plan = json.loads(env.get("PHALANX_TEST_PROGRAMS", "[]"))
        programs = [p[1] if p[0] == "chief-only" else p[0] for p in plan]
    elif cmd[1:3] == ["-m", "phalanx.cli"]:
        args = [str(a) for a in cmd[3:]]
        programs = [a for a in args if a.endswith(".py")]
        asked = [m.strip() for i, a in enumerate(args[:-1]) if a == "--preload" for m in args[i + 1].split(",")]
        programs += [m for m in asked if m == "keras"]
    else:
        return None
    keras = "keras" in programs or any(
        "keras" in preload_for([sys.executable, str(program)], env) for program in programs
    )
    server = shared_fork_server(preload_for(cmd, env, extra=("keras",) if keras else ()))
    if forkable(cmd, env, server.env) is not None:
        return None
    return server


def shared_fork_server(preload: tuple[str, ...]):
    """This test process's fork server for ``preload`` (started on first use, kept to the end)."""
    from phalanx.launch.forkserver import ForkServer

    server = _FORK_SERVERS.get(preload)
    if server is None or not server.alive:  # a test that kills every child of this process
        server = _FORK_SERVERS[preload] = ForkServer(preload)
    return server


def fork_server_pids() -> set[int]:
    return {s.pid for s in _FORK_SERVERS.values() if s.pid is not None}


def pytest_configure(config):
    """Writes phalanx's bytecode once, before any job starts (in the controlling process only).

    Every job imports phalanx afresh, in about 350 processes per run. Under
    ``PYTHONDONTWRITEBYTECODE=1`` (this machine's setting) an editable install has no ``.pyc``,
    so each process compiled the modules it imports again: importing phalanx, a strategy and
    phalanx.keras in a forked process took 0.11 CPU-second without and 0.045 with. A regular
    install compiles at install time; ``compileall`` does the same here (it writes even under
    that setting; Python still reads what it finds).
    """
    if hasattr(config, "workerinput"):  # an xdist worker: the controller did it
        return
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("phalanx")
    for folder in spec.submodule_search_locations if spec is not None else []:
        compileall.compile_dir(folder, quiet=2)


def pytest_sessionfinish(session, exitstatus):
    for server in _FORK_SERVERS.values():
        server.close()


def start_process(cmd: list[str], *, cwd: Path, env: dict[str, str], out, fresh: bool = False):
    """Starts ``cmd`` in its own session, stdout and stderr to the file ``out``."""
    server = None if fresh else _fork_server_for(cmd, env)
    if server is not None:
        return server.spawn(cmd, env=env, cwd=str(cwd), stdout=out.fileno(), stderr=subprocess.STDOUT, new_session=True)
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )


@pytest.fixture(autouse=True)
def _close_strategies_left_open():
    """A strategy a test leaves open (threaded ranks, say) would stay the process's live strategy and
    answer phalanx.process_index() / is_chief() for the tests after it: close what the test made."""
    import phalanx.core.strategy as strategy_module

    before = {id(ref()) for ref in list(strategy_module._LIVE) if ref() is not None}
    yield
    for ref in list(strategy_module._LIVE):
        strategy = ref()
        if strategy is not None and id(strategy) not in before and not strategy._closed:
            try:
                strategy.close()
            except Exception:  # a communicator whose peers are gone: nothing left to release
                pass


@pytest.fixture(autouse=True)
def _hygiene():
    """Fails a test that leaks child processes, threads or environment variables."""
    env_before = dict(os.environ)
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    me = psutil.Process()
    servers = fork_server_pids()
    deadline = time.monotonic() + 5
    while [p for p in me.children(recursive=True) if p.pid not in servers] and time.monotonic() < deadline:
        time.sleep(0.05)
    leaked = [p for p in me.children(recursive=True) if p.pid not in servers]
    for p in leaked:
        p.kill()
    assert not leaked, f"test leaked child processes: {[(p.pid, p.cmdline()) for p in leaked]}"
    env_after = dict(os.environ)
    env_after.pop("PYTEST_CURRENT_TEST", None)
    env_before.pop("PYTEST_CURRENT_TEST", None)
    assert env_after == env_before, "test leaked environment variables: " + str(
        {k for k in env_before.keys() ^ env_after.keys()}
        | {k for k in env_before if env_after.get(k, env_before[k]) != env_before[k]}
    )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in threads_before and not t.daemon and t.is_alive()]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, f"test leaked threads: {extra}"


class JobResult:
    def __init__(self, returncode: int, output: str, log_dir: Path, elapsed: float) -> None:
        self.returncode, self.output, self.log_dir, self.elapsed = returncode, output, log_dir, elapsed

    def logs(self) -> str:
        parts = [self.output]
        for path in sorted(self.log_dir.rglob("*.log")):
            parts.append(f"--- {path} ---\n{path.read_text(errors='replace')}")
        return "\n".join(parts)


def _session_processes(pid: int) -> list[psutil.Process]:
    try:
        sid = os.getsid(pid)
    except ProcessLookupError:
        return []
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid:
                found.append(p)
        except (ProcessLookupError, psutil.Error, PermissionError):
            continue
    return found


def _hung_processes(pid: int) -> list[psutil.Process]:
    """The processes of the job started as ``pid``, to dump the stacks of: its session, and the
    children of this test process's fork servers (the tasks a forked program forked from them)."""
    found = _session_processes(pid)
    servers = fork_server_pids()
    for server in servers:
        try:
            found += [p for p in psutil.Process(server).children(recursive=True) if p.pid not in servers]
        except psutil.Error:
            continue
    return list({p.pid: p for p in found}.values())


def run_job(
    cmd: list[str],
    *,
    timeout: float,
    cwd: Path,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    fresh: bool = False,
) -> JobResult:
    """Runs ``cmd`` in its own session; on timeout dumps every process's stack, kills all, fails.

    ``fresh``: start it as a fresh interpreter even where it could be forked (see ``_start``).
    """
    log_dir = log_dir or (cwd / "logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PHALANX_LOG_ROOT": str(log_dir), "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("PYTEST_CURRENT_TEST", None)
    start = time.monotonic()
    out_file = tempfile.TemporaryFile()  # noqa: SIM115 - read once the job has ended, then closed
    proc = start_process(cmd, cwd=cwd, env=full_env, out=out_file, fresh=fresh)

    def output() -> str:
        out_file.seek(0)
        return out_file.read().decode(errors="replace")

    try:
        proc.wait(timeout=timeout)
        out = output()
    except subprocess.TimeoutExpired:
        procs = _hung_processes(proc.pid)
        for p in procs:
            try:
                p.send_signal(_stack_signal())
            except psutil.Error:
                pass
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        result = JobResult(-9, output(), log_dir, time.monotonic() - start)
        pytest.fail(f"job timed out after {timeout}s: {cmd}\n{result.logs()[-20000:]}")
    finally:
        for p in _session_processes(proc.pid):
            try:
                p.kill()
            except psutil.Error:
                pass
        out_file.close()
    return JobResult(proc.returncode, out, log_dir, time.monotonic() - start)


def run_jobs(
    jobs: list[tuple[list[str], dict[str, str]]], *, timeout: float, cwd: Path, wait_for: list[int] | None = None
) -> list[JobResult]:
    """Runs several commands at once (e.g. one per TF_CONFIG task) under one hard deadline.

    ``wait_for`` names the jobs whose end is awaited (default: all); the rest are killed after.
    """
    log_root = cwd / "logs"
    procs = []
    start = time.monotonic()
    for i, (cmd, env) in enumerate(jobs):
        out = open(cwd / f"job_{i}.out", "w")  # noqa: SIM115
        full_env = {**os.environ, "PHALANX_LOG_ROOT": str(log_root / str(i)), "PYTHONUNBUFFERED": "1", **env}
        full_env.pop("PYTEST_CURRENT_TEST", None)
        procs.append((start_process(cmd, cwd=cwd, env=full_env, out=out), out))
    ended = {}
    try:
        awaited = set(range(len(procs)) if wait_for is None else wait_for)
        while not awaited <= set(ended):
            for i, (p, _) in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.monotonic() - start
            if time.monotonic() - start > timeout:
                for p, _ in procs:
                    for q in _hung_processes(p.pid):
                        try:
                            q.send_signal(_stack_signal())
                        except psutil.Error:
                            pass
                time.sleep(1.0)
                text = "\n".join(f"--- job {i} ---\n" + (cwd / f"job_{i}.out").read_text() for i in range(len(procs)))
                pytest.fail(f"jobs timed out after {timeout}s\n{text[-20000:]}")
            time.sleep(0.02)
    finally:
        for p, out in procs:
            for q in _session_processes(p.pid):
                try:
                    q.kill()
                except psutil.Error:
                    pass
            p.wait()
            out.close()
    return [
        JobResult(p.returncode, (cwd / f"job_{i}.out").read_text(), log_root / str(i), ended.get(i, -1.0))
        for i, (p, _) in enumerate(procs)
    ]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports outside the kernel's ephemeral range (see `phalanx.launch.env.free_port`):
    no client connection of a test running beside this one can take them before they are bound."""
    from phalanx.launch.env import free_port

    return [free_port() for _ in range(n)]


def tf_config(workers: list[str], index: int, task_type: str = "worker", **extra_jobs: list[str]) -> dict[str, str]:
    return {
        "TF_CONFIG": json.dumps(
            {"cluster": {"worker": workers, **extra_jobs}, "task": {"type": task_type, "index": index}}
        )
    }


@pytest.fixture
def script(tmp_path: Path):
    """Writes a replica script (with the stack-dump prelude) and returns its path."""

    def write(body: str, name: str = "job.py") -> Path:
        path = tmp_path / name
        path.write_text(PRELUDE + textwrap.dedent(body))
        return path

    return write


@pytest.fixture
def python() -> str:
    return sys.executable


def jobs_on_first_use(factory, stem: str, command, *, timeout: float):
    """A function ``run(key) -> folder``: the job ``command(key, folder)`` runs once, on first use.

    For module-scoped fixtures whose jobs share replica processes between cases (one job per world
    size, say): a test that needs only one key starts only that job. A failed job fails the test
    that first asked for it, with every process's log.
    """
    done: dict = {}

    def run(key) -> Path:
        if key not in done:
            out = factory.mktemp(f"{stem}{key}")
            res = run_job(command(key, out), timeout=timeout, cwd=out)
            assert res.returncode == 0, res.logs()
            done[key] = out
        return done[key]

    return run


RUN_PROGRAMS = Path(__file__).parent / "scripts" / "run_programs.py"


def programs_job_env(programs: list[list[str]]) -> dict[str, str]:
    """The environment that makes ``scripts/run_programs.py`` run ``programs`` one after the other."""
    return {"PHALANX_TEST_PROGRAMS": json.dumps([[str(a) for a in p] for p in programs])}


def program_output(returncode: int, output: str, index: int, count: int, name: str) -> str:
    """Program ``index``'s own output from a ``scripts/run_programs.py`` job of ``count`` programs.

    Fails naming ``name`` when the program did not start (an earlier program of the job failed) or
    did not finish, and when the job failed after every program finished (e.g. at exit).
    """
    start, end = f"<<< START {index}\n", f"<<< END {index}\n"
    if start not in output:
        pytest.fail(f"{name} did not run (the job never started it: an earlier program failed?)\n{output[-8000:]}")
    text = output.split(start, 1)[1]
    if end not in text:
        pytest.fail(f"{name} did not finish (the job exited {returncode})\n{text[-8000:]}")
    if returncode != 0 and f"<<< END {count - 1}\n" in output:
        pytest.fail(f"the job of {name} exited {returncode} after its programs finished\n{output[-8000:]}")
    return text.split(end, 1)[0]


def has_fsdp2() -> bool:
    """Whether this torch has FSDP2 (``torch.distributed.fsdp.fully_shard``, torch >= 2.6)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:  # pragma: no cover - torch < 2.6
        return False
    return True


def benchmark_module(name: str):
    """``benchmarks.<name>`` imported from the repository (not an installed package), for tests
    that check what a benchmark reports without running it in full."""
    import importlib

    root = str(Path(__file__).resolve().parent.parent)
    sys.path.insert(0, root)
    try:
        return importlib.import_module(f"benchmarks.{name}")
    finally:
        sys.path.remove(root)


def client_or_skip(module: str):
    """Imports a tracker's client (``mlflow``, ``wandb``, ``tensorboard``); skips where it is not
    installed, and fails where it is installed but does not import (a floor that needs something the
    metadata does not install must fail the oldest-versions job, not skip in it)."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed", allow_module_level=True)
    return importlib.import_module(module)
