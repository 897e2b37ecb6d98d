"""The fork start (phalanx.launch.forkserver): a forked program is the program ``python`` runs.

Each case runs one probe program both ways, a fresh interpreter (``subprocess``) and a fork of a
server that preloaded numpy and torch, and compares what the program saw and did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from phalanx.errors import ClusterSpecError
from phalanx.launch import settings
from phalanx.launch.forkserver import ForkServer, forkable, preload_for
from phalanx.launch.root_cause import Task
from phalanx.launch.supervisor import Supervisor

from conftest import run_job, shared_fork_server

PROBE = textwrap.dedent(
    """
    import atexit, json, os, sys, threading, time
    report = {
        "argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": globals().get("__file__"),
        "spec": getattr(globals().get("__spec__"), "name", None), "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
        "stdin": sys.stdin.read(), "main_is_module": sys.modules["__main__"].__dict__ is globals(),
        "preloaded": "torch" in sys.modules,
    }
    def late():
        time.sleep(0.3)
        print("thread joined", flush=True)  # a non-daemon thread: the interpreter waits for it
    threading.Thread(target=late).start()
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps(report), flush=True)
    if "raise" in sys.argv:
        raise ValueError("the probe failed on purpose")
    if "exit" in sys.argv:
        sys.exit(7)
    """
)


@pytest.fixture
def server():
    return shared_fork_server(("numpy", "torch"))  # kept for the session, as the job runner's


def _fresh(cmd, cwd, env):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def _forked(server, cmd, cwd, env, tmp_path):
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = server.spawn(cmd, env=env, cwd=str(cwd), stdout=o.fileno(), stderr=e.fileno())
    code = proc.wait(timeout=120)
    return code, out.read_text(), err.read_text()


@pytest.mark.parametrize("form", ["script", "script-raise", "script-exit", "module", "code"])
def test_a_forked_program_sees_and_does_what_a_fresh_interpreter_does(server, tmp_path, form):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE)
    if form.startswith("script"):
        cmd = [sys.executable, str(pkg / "probe.py"), "a b", *form.split("-")[1:]]
    elif form == "module":
        cmd = [sys.executable, "-m", "pkg.probe", "x"]
    else:
        cmd = [sys.executable, "-c", PROBE, "y"]
    env = {**os.environ, "PROBE_VALUE": "v1"}
    fresh = _fresh(cmd, tmp_path, env)
    forked = _forked(server, cmd, tmp_path, env, tmp_path)
    assert forked[0] == fresh[0] == {"script-raise": 1, "script-exit": 7}.get(form, 0), (fresh, forked)
    seen = [json.loads(out.splitlines()[0]) for _, out, _ in (fresh, forked)]
    assert seen[1].pop("preloaded") is True and seen[0].pop("preloaded") is False
    assert seen[1] == seen[0]
    assert [line for line in forked[1].splitlines()[1:]] == ["thread joined", "atexit ran"], forked
    assert forked[1].splitlines()[1:] == fresh[1].splitlines()[1:]
    assert forked[2] == fresh[2]  # the traceback of an uncaught exception: the same text, no server frames
    if form == "script-raise":
        assert "ValueError: the probe failed on purpose" in forked[2] and "forkserver" not in forked[2]


def test_children_get_their_own_entropy_and_thread_count(server, tmp_path):
    """numpy's global generator is reseeded in every child (a fresh process draws its own), and an
    OMP_NUM_THREADS of the task's own is applied (libgomp read the server's at load)."""
    code = "import numpy, torch; print(numpy.random.rand(), torch.get_num_threads())"
    outs = []
    for _ in range(2):
        rc, out, err = _forked(
            server, [sys.executable, "-c", code], tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path
        )
        assert rc == 0, err
        outs.append(out.split())
    assert outs[0][0] != outs[1][0]
    assert outs[0][1] == outs[1][1] == "1"


def test_what_cannot_be_forked_is_named():
    env = dict(os.environ)
    assert forkable([sys.executable, "train.py"], env, env) is None
    assert "PYTHONPATH" in forkable([sys.executable, "t.py"], {**env, "PYTHONPATH": "/elsewhere"}, env)
    assert "KERAS_BACKEND" in forkable([sys.executable, "t.py"], {**env, "KERAS_BACKEND": "jax"}, env)
    assert "options" in forkable([sys.executable, "-u", "t.py"], env, env)
    assert "not this Python" in forkable(["/bin/echo", "t.py"], env, env)
    # a replica's identity and the launcher's bookkeeping are not read at start-up
    assert forkable([sys.executable, "t.py"], {**env, "RANK": "1", "TORCHELASTIC_ERROR_FILE": "/x"}, env) is None
    with pytest.raises(ValueError, match="PYTHONPATH"):
        ForkServer(preload=()).spawn([sys.executable, "t.py"], env={**env, "PYTHONPATH": "/elsewhere"})


def test_keras_is_preloaded_only_for_a_program_that_imports_it(tmp_path):
    plain, with_keras = tmp_path / "plain.py", tmp_path / "k.py"
    plain.write_text("import torch\n")
    with_keras.write_text("import os\nfrom keras import layers\n")
    assert "keras" not in preload_for([sys.executable, str(plain)])
    assert "torch" in preload_for([sys.executable, str(plain)])
    assert "keras" in preload_for([sys.executable, str(with_keras)], {"KERAS_BACKEND": "torch"})
    assert "keras" not in preload_for([sys.executable, str(with_keras)], {"KERAS_BACKEND": "jax"})
    assert "keras" not in preload_for([sys.executable, str(with_keras)], {})  # Keras's default is not torch
    pinned = tmp_path / "pinned.py"  # the examples' way: the script picks the torch backend itself
    pinned.write_text('import os\nos.environ.setdefault("KERAS_BACKEND", "torch")\nimport keras\n')
    assert "keras" in preload_for([sys.executable, str(pinned)], {})
    assert "keras" not in preload_for([sys.executable, str(pinned)], {"KERAS_BACKEND": "jax"})
    # --preload: a module the script imports through one of its own
    assert preload_for([sys.executable, str(plain)], {"KERAS_BACKEND": "torch"}, extra=("keras", "scipy"))[-2:] == (
        "keras",
        "scipy",
    )


def test_a_killed_server_takes_its_children_and_reports_them_killed(tmp_path):
    srv = ForkServer(preload=())
    try:
        proc = srv.spawn([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ))
        assert psutil.Process(proc.pid).ppid() == srv.pid
        os.kill(srv.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(proc.pid) and psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child outlived its server"
            time.sleep(0.02)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        srv.close()


def test_the_supervisor_forks_what_it_can_and_spawns_the_rest(tmp_path, capsys):
    """start_method='fork': a plain Python task is forked from the server (its parent), a task
    whose environment changes what the interpreter reads at start-up is spawned, and says so."""
    sup = Supervisor(start_method="fork")
    try:
        code = "import os, sys; print(os.getppid(), 'torch' in sys.modules)"
        forked = sup.start(Task(name="forked", command=(sys.executable, "-c", code), log_path=str(tmp_path / "a.log")))
        spawned = sup.start(
            Task(
                name="spawned",
                command=(sys.executable, "-c", code),
                env={"PYTHONPATH": str(tmp_path)},
                log_path=str(tmp_path / "b.log"),
            )
        )
        assert sup.wait(forked, 60) == 0 and sup.wait(spawned, 60) == 0
        parent, preloaded = (tmp_path / "a.log").read_text().split()
        assert int(parent) == sup.fork_server.pid and preloaded == "True"
        parent, preloaded = (tmp_path / "b.log").read_text().split()
        assert int(parent) == os.getpid() and preloaded == "False"
        assert "spawned starts a fresh interpreter (PYTHONPATH differs" in capsys.readouterr().err
    finally:
        sup.close()


def test_start_method_setting(monkeypatch):
    monkeypatch.delenv("PHALANX_START_METHOD", raising=False)
    assert settings.start_method() == "fork"  # Linux
    monkeypatch.setenv("PHALANX_START_METHOD", "spawn")
    assert settings.start_method() == "spawn"
    monkeypatch.setenv("PHALANX_START_METHOD", "forkserver")
    with pytest.raises(ClusterSpecError, match="forkserver"):
        settings.start_method()
    with pytest.raises(ValueError, match="threads"):
        Supervisor(start_method="threads")


def test_phalanx_run_fork_and_spawn_starts_run_the_same_program(tmp_path):
    """`phalanx run -n 2` under both starts: the same replica output; under fork the replicas are
    children of the job's fork server (and torch was imported before the script ran), under spawn
    of the launcher itself."""
    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(
            """
            import os, sys
            preloaded = "torch" in sys.modules
            import psutil, torch, phalanx
            strategy = phalanx.MirroredStrategy()
            total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1)), axis=None)
            parent = psutil.Process(os.getppid()).cmdline()
            print(f"replica {phalanx.process_index()}: sum {total.item()} preloaded {preloaded}",
                  "server" if "phalanx.launch.forkserver" in parent else "launcher", flush=True)
            """
        )
    )
    outputs = {}
    for method in ("fork", "spawn"):
        res = run_job(
            [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", "--tee", "--start-method", method, str(job)],
            timeout=180,
            cwd=tmp_path,
            log_dir=tmp_path / method,
            fresh=True,  # the launcher as a shell starts it: a forked one would fork from the suite's server
        )
        assert res.returncode == 0, res.logs()
        outputs[method] = sorted(line for line in res.output.splitlines() if line.startswith("[replica"))
    assert outputs["fork"] == [f"[replica {r}] replica {r}: sum 2.0 preloaded True server" for r in (0, 1)]
    assert outputs["spawn"] == [f"[replica {r}] replica {r}: sum 2.0 preloaded False launcher" for r in (0, 1)]


_NESTED = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from phalanx.launch.forkserver import has_inherited_server, inherited_server
    # A process this one starts (exec'd, or forked by the program itself) inherits the variable,
    # not the connection: it finds no server.
    probe = "from phalanx.launch.forkserver import inherited_server as i; print(i() is None)"
    fresh_none = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if inherited_server() is None else 1)
    fork_none = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    available = has_inherited_server()
    server = inherited_server()
    second = inherited_server()  # once per process
    r, w = os.pipe()
    code = "import os, sys, time; print(os.getppid(), 'torch' in sys.modules, flush=True); time.sleep(float(sys.argv[1])); sys.exit(5)"
    task = server.spawn([sys.executable, "-c", code, sys.argv[1]], env=dict(os.environ), stdout=w)
    os.close(w)
    with os.fdopen(r) as pipe:
        line = pipe.readline().split()  # (one os.read may return part of the line)
    print(json.dumps({"fresh_none": fresh_none, "fork_none": fork_none, "available": available,
                      "second_none": second is None, "server": server.pid, "task": task.pid,
                      "parent": int(line[0]), "preloaded": line[1]}), flush=True)
    print(task.wait(timeout=60), flush=True)
    # A task started with the default stdout writes to this program's, not to the server's.
    quiet = server.spawn([sys.executable, "-c", "print('the task wrote here')"], env=dict(os.environ))
    print(quiet.wait(timeout=60), flush=True)
    server.close()
    """
)


def test_a_forked_program_forks_its_tasks_from_the_server_it_came_from(server, tmp_path):
    """A supervisor in a forked program (a self-launching script, a forked `phalanx run`) forks its
    tasks from the same server: each task is the server's child with torch imported, its exit is
    reported to the program, and its output goes where the program's does. Only the program the
    server forked can use its connection."""
    code, out, err = _forked(server, [sys.executable, "-c", _NESTED, "0"], tmp_path, dict(os.environ), tmp_path)
    assert code == 0, err
    lines = out.splitlines()
    seen = json.loads(lines[0])
    assert seen["fresh_none"] == "True" and seen["fork_none"] is True, seen
    assert seen["available"] is True and seen["second_none"] is True, seen
    assert seen["server"] == seen["parent"] == server.pid and seen["preloaded"] == "True", seen
    assert lines[1] == "5", out  # the task's exit code, as the server reported it to the program
    assert lines[2:] == ["the task wrote here", "0"], out


def test_a_launcher_without_stdout_still_starts_tasks(tmp_path):
    """A launcher whose stdout is closed (a daemon's) starts its task with /dev/null there: a
    closed descriptor cannot be sent to the server."""
    code = textwrap.dedent(
        """
        import os, sys
        from phalanx.launch.forkserver import ForkServer
        with ForkServer(preload=()) as server:
            server.start()
            os.close(1)
            task = server.spawn([sys.executable, "-c", "print('into the void')"], env=dict(os.environ))
            sys.exit(task.wait(timeout=60))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_tasks_of_a_killed_program_die_with_it(server, tmp_path):
    """kill -9 of a forked program: the server kills the tasks it forked for it (as the death of
    their parent would, with PR_SET_PDEATHSIG), within a bounded time."""
    out = tmp_path / "out.txt"
    with open(out, "wb") as o:
        program = server.spawn([sys.executable, "-c", _NESTED, "120"], env=dict(os.environ), stdout=o.fileno())
    try:
        deadline = time.monotonic() + 60
        while "\n" not in out.read_text():  # its first line, whole
            assert program.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.02)
        task = json.loads(out.read_text().splitlines()[0])["task"]
        assert psutil.Process(task).ppid() == server.pid
        program.kill()
        killed = time.monotonic()
        while psutil.pid_exists(task) and psutil.Process(task).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() - killed < 5, "the task outlived the program that started it"
            time.sleep(0.02)
    finally:
        program.kill()
        program.wait(timeout=30)


def test_self_launch_forks_from_two_replicas_on(tmp_path):
    """`python job.py` with 3 replicas: replica 0 starts a fork server for replicas 1 and 2 (one
    import for two); with 2 replicas, replica 1 is spawned (the server would cost what it saves),
    unless replica 0 was itself forked from a server: replica 1 is then forked from that one."""
    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(
            """
            import os, sys
            preloaded = "torch" in sys.modules
            import psutil, torch, phalanx
            n, tag = int(sys.argv[1]), sys.argv[2]
            strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(n)])
            total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1)), axis=None)
            parent = psutil.Process(os.getppid())
            server = "server" if "phalanx.launch.forkserver" in parent.cmdline() else "other"
            with open(f"replica_{tag}_{phalanx.process_index()}.txt", "w") as f:
                f.write(f"{total.item()} {preloaded} {server} {parent.pid}")
            """
        )
    )
    for n, fresh in ((2, True), (3, True), (2, False)):
        tag = f"{n}{'' if fresh else 'forked'}"
        res = run_job(
            [sys.executable, str(job), str(n), tag], timeout=180, cwd=tmp_path, log_dir=tmp_path / tag, fresh=fresh
        )
        assert res.returncode == 0, res.logs()
    seen = {p.stem: p.read_text().rsplit(" ", 1) for p in tmp_path.glob("replica_*.txt")}
    assert {name: what for name, (what, _) in seen.items()} == {
        "replica_2_0": "2.0 False other",
        "replica_2_1": "2.0 False other",
        "replica_3_0": "3.0 False other",
        "replica_3_1": "3.0 True server",
        "replica_3_2": "3.0 True server",
        "replica_2forked_0": "2.0 True server",
        "replica_2forked_1": "2.0 True server",
    }
    assert seen["replica_3_1"][1] == seen["replica_3_2"][1] != seen["replica_2forked_0"][1]  # replica 0's own server
    assert seen["replica_2forked_0"][1] == seen["replica_2forked_1"][1]  # the one replica 0 came from


def test_a_fork_server_that_cannot_start_leaves_the_job_to_fresh_interpreters(tmp_path, monkeypatch, capsys):
    """A preloaded module that ends the server: the supervisor says so and spawns the task."""
    (tmp_path / "dies_at_import.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    sup = Supervisor(start_method="fork", preload=("dies_at_import",))
    try:
        run = sup.start(
            Task(name="t", command=(sys.executable, "-c", "print('ran')"), log_path=str(tmp_path / "t.log"))
        )
        assert sup.wait(run, 60) == 0
        assert (tmp_path / "t.log").read_text() == "ran\n"
        assert "The fork server did not start" in capsys.readouterr().err and sup.start_method == "spawn"
    finally:
        sup.close()
