"""The right culprit named, and messages that say what went wrong (issue 29, items 3 and 4).

* A replica that stalls (alive, never arriving at a collective: SIGSTOP, a debugger, a livelock)
  is the root cause in the launcher's summary, not the peer that timed out waiting for it; the
  stopped process is killed, and the job fails.
* A checkpoint save that runs out of disk names the checkpoint, its directory and the free space.
* An own address that is not this host's quotes the configured port, not the port 0 of the probe.
* A master host that does not resolve says so, within the rendezvous timeout.
* A rendezvous that times out prints phalanx's typed error, never torch's C++ stack trace first.
* A signed parameter-server frame with a header field of the wrong JSON type (``true`` for a
  dimension, a string for a learning rate) is refused with INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from phalanx.errors import DiskFullError, WriteError
from phalanx.launch.root_cause import Exit, Task, root_cause
from phalanx.launch.supervisor import Supervisor

from conftest import free_ports, run_job, run_jobs, tf_config

COLLECTIVE_TIMEOUT = 6.0  # the replicas start under load first: only the stall may take this long
RENDEZVOUS_TIMEOUT = 4.0
CPP_TRACE = re.compile(r"^(frame #\d+|Exception raised from )", re.MULTILINE)

# Replica 1 stops itself (SIGSTOP: alive, but it never arrives) before its step-3 all-reduce;
# replica 0 waits there until the collective timeout. Each replica records its pid first.
STALL_ON_1 = """
import os, signal
from pathlib import Path
import torch
import phalanx as px

strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
rank = strategy.extended.process_index
Path(f"pid_{rank}").write_text(str(os.getpid()))
with strategy.scope():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x):
    loss = px.nn.compute_average_loss(model(x).square().sum(1), global_batch_size=8)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


for i in range(1, 6):
    if rank == 1 and i == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    strategy.run(step, args=(torch.ones(4, 4),))
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("launcher", ["run", "self"])
def test_a_stalled_replica_is_the_root_cause_not_the_peer_that_waited_for_it(tmp_path, launcher):
    program = tmp_path / "job.py"
    program.write_text(STALL_ON_1)
    cmd = [sys.executable, str(program)]
    if launcher == "run":
        cmd = [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(program)]
    env = {"PHALANX_COLLECTIVE_TIMEOUT": str(COLLECTIVE_TIMEOUT), "OMP_NUM_THREADS": "1"}
    res = run_job(cmd, timeout=120, cwd=tmp_path, env=env)
    out = res.output
    assert res.returncode != 0, out
    causes = out.split("phalanx: root cause (first failure): ")
    assert len(causes) == 2, out
    report = causes[1]
    assert report.startswith("replica 1"), out
    assert "stalled" in report and "replica 0" in report and "CollectiveTimeoutError" in report, report
    stopped = int((tmp_path / "pid_1").read_text())
    assert _gone(stopped), f"the stalled replica (pid {stopped}) outlived the job"


TIMEOUT_ON_0 = (
    "CollectiveTimeoutError: all-reduce on replica:0 (rank 0) failed at step 3: replica:1 (rank 1) is unavailable "
    "(shm all_reduce failed: rank 1 is unavailable (alive but did not arrive within 3s).). HINT: restart"
)


def _plain_task(tmp_path: Path, name: str, body: str) -> Task:
    """A plain-Python task (no torch) that may record an error as replicas do (torch elastic's format)."""
    error = tmp_path / f"{name}.error.json"
    prelude = (
        "import json, os, signal, sys, time\n"
        "def record(message):\n"
        f"    with open({str(error)!r}, 'w') as f:\n"
        "        json.dump({'message': message, 'timestamp': int(time.time())}, f)\n"
    )
    return Task(
        name=name,
        command=(sys.executable, "-c", prelude + body),
        log_path=str(tmp_path / f"{name}.log"),
        error_path=str(error),
    )


@pytest.mark.parametrize(
    ("body", "state"),
    [("os.kill(os.getpid(), signal.SIGSTOP)", "stopped (SIGSTOP"), ("time.sleep(60)", "running (deadlocked")],
)
def test_the_supervisor_names_the_replica_a_timeout_waited_for(tmp_path, body, state):
    out = io.StringIO()
    sup = Supervisor(out=out)
    stalled = sup.start(_plain_task(tmp_path, "replica 1", body))
    try:
        time.sleep(0.3)  # it has stopped (or sleeps) before its peer times out
        sup.start(_plain_task(tmp_path, "replica 0", f"record({TIMEOUT_ON_0!r}); sys.exit(1)"))
        deadline = time.monotonic() + 30
        while not any(e.failed for e in sup.poll()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sup.stop_after_failure(grace=0.5)
    finally:
        sup.kill()
    cause = sup.report_root_cause()
    assert cause is not None and cause.task.name == "replica 1" and cause.status == 1, out.getvalue()
    text = out.getvalue()
    assert "replica 1" in text and "stalled" in text and state in text, text
    assert "replica 0's error: CollectiveTimeoutError: all-reduce on replica:0" in text, text
    assert stalled.popen.poll() is not None and not sup.alive()


def test_a_replica_that_died_is_not_called_stalled(tmp_path):
    """A lost peer (PeerUnavailableError: it exited) names no stall; nor does a timeout that names
    a task other than the one the supervisor stopped."""
    dead = Exit(Task(name="replica 1", command=("x",)), 2, -9, 1, stopped_by_supervisor=True)
    waiter = Exit(Task(name="replica 0", command=("x",)), 1, 1, 0, message=TIMEOUT_ON_0.replace("Collective", "X"))
    assert not root_cause([waiter, dead]).stalled
    other = Exit(Task(name="replica 2", command=("x",)), 3, -9, 1, stopped_by_supervisor=True)
    waiter = Exit(Task(name="replica 0", command=("x",)), 1, 1, 0, message=TIMEOUT_ON_0)
    assert root_cause([waiter, other]).task.name == "replica 0"
    assert root_cause([waiter, other, dead]).stalled


# ----------------------------------------------------------------------------- a full disk
def _save(directory: Path, numel: int) -> None:
    from phalanx.checkpoint import Checkpoint

    model = torch.nn.Linear(numel, 1, bias=False)
    Checkpoint(model=model).save(str(directory / "ckpt"))


def _check_disk_full(e: DiskFullError, directory: Path) -> None:
    assert isinstance(e, OSError) and isinstance(e, WriteError), type(e).__mro__
    assert e.errno == errno.ENOSPC
    text = str(e)
    assert str(directory / "ckpt") in text and "No space left" in text, text
    assert e.directory == str(directory) and e.path == str(directory / "ckpt-1"), (e.directory, e.path)
    # Nothing half-written is left behind: the next save (or a restore) sees only whole checkpoints.
    assert not [n for n in os.listdir(directory) if n.startswith(".ckpt")], os.listdir(directory)


def test_a_save_that_runs_out_of_disk_names_the_checkpoint_and_the_free_space(tmp_path, monkeypatch):
    from phalanx.checkpoint import storage

    real = os.fsync

    def full(fd):  # the kernel reports a full disk at the latest when the data is flushed
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(storage.os, "fsync", full)
    with pytest.raises(DiskFullError) as info:
        _save(tmp_path, 8)
    monkeypatch.setattr(storage.os, "fsync", real)
    _check_disk_full(info.value, tmp_path)
    assert "free" in str(info.value), str(info.value)


def test_a_save_on_a_real_full_file_system(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True, capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a small tmpfs here ({e})")
    try:
        with pytest.raises(DiskFullError) as info:
            _save(mount, 64 * 1024)  # 256 KiB of float32: 4 times what the file system holds
        _check_disk_full(info.value, mount)
        assert "bytes free" in str(info.value), str(info.value)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True, timeout=30)


# ----------------------------------------------------------------------------- rendezvous messages
MWMS = """
import phalanx as px
px.MultiWorkerMirroredStrategy()
print("built")
"""


@pytest.fixture(scope="module")
def rendezvous_failures(tmp_path_factory):
    """One batch of failing rendezvous, run at once: case -> (exit code, output, seconds)."""
    folder = tmp_path_factory.mktemp("rendezvous")
    program = folder / "mwms.py"
    program.write_text(MWMS)
    taken_port, nobody = free_ports(2)
    base = {"PHALANX_RENDEZVOUS_TIMEOUT": str(RENDEZVOUS_TIMEOUT), "OMP_NUM_THREADS": "1"}
    torchrun = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    cases = {
        # worker 1's own address is not this host's (TEST-NET-1): the message quotes its configured port
        "own address": tf_config(["127.0.0.1:1", f"192.0.2.1:{taken_port}"], 1),
        "master does not resolve": {**torchrun, "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": str(nobody)},
        "chief does not resolve": tf_config([f"no-such-host.invalid:{nobody}", "127.0.0.1:1"], 1),
        "nobody serves the port": tf_config([f"127.0.0.1:{nobody}", "127.0.0.1:1"], 1),
        "torch's logs asked for": {
            **tf_config([f"127.0.0.1:{nobody}", "127.0.0.1:1"], 1),
            "TORCH_CPP_LOG_LEVEL": "INFO",
        },
    }
    jobs = [([sys.executable, str(program)], {**base, **env}) for env in cases.values()]
    results = run_jobs(jobs, timeout=90, cwd=folder)
    return {case: (r.returncode, r.output, r.elapsed) for case, r in zip(cases, results)}


def test_an_own_address_error_quotes_the_configured_port(rendezvous_failures):
    code, out, _ = rendezvous_failures["own address"]
    assert code != 0 and "ClusterSpecError" in out, out
    port = re.search(r"192\.0\.2\.1:(\d+)", out)
    assert port and port.group(1) != "0" and "192.0.2.1:0" not in out, out
    assert "is not an address of this host" in out, out


@pytest.mark.parametrize("case", ["master does not resolve", "chief does not resolve"])
def test_a_master_host_that_does_not_resolve_says_so_within_the_timeout(rendezvous_failures, case):
    code, out, took = rendezvous_failures[case]
    assert code != 0, out
    assert "'no-such-host.invalid' does not resolve" in out, out
    assert "nothing answered" not in out, out
    assert took < RENDEZVOUS_TIMEOUT + 20, took  # interpreter start-up under load included
    assert not CPP_TRACE.search(out), out


def test_a_rendezvous_timeout_prints_no_cpp_stack_trace(rendezvous_failures):
    code, out, _ = rendezvous_failures["nobody serves the port"]
    assert code != 0 and "RendezvousTimeoutError" in out, out
    assert not CPP_TRACE.search(out), out
    assert "[c10d]" not in out, out


def test_a_user_who_asks_for_torchs_logs_still_gets_them(rendezvous_failures):
    """Phalanx keeps torch's client quiet only where it reports the failure itself: a user who sets
    ``TORCH_CPP_LOG_LEVEL`` sees torch's own lines about the connection, then phalanx's error."""
    code, out, _ = rendezvous_failures["torch's logs asked for"]
    assert code != 0 and "RendezvousTimeoutError" in out, out
    assert "[c10d]" in out, out


# ----------------------------------------------------------------------------- parameter-server frames
SECRET = b"s" * 32

# Each request is well formed; each mutation below puts a value of the wrong JSON type in one field.
WRONG = [True, False, None, "x", -1, 1.5, [], {}, [True], [[1]], {"a": 1}, 2**70]


def _requests() -> list[tuple[str, dict, list[torch.Tensor]]]:
    w = torch.zeros(4)
    sgd = {"class": "SGD", "hyper": {"lr": 0.1, "momentum": 0.9}}
    return [
        ("create", {"vars": [{"key": "w", "trainable": True}]}, [w]),
        ("read", {"keys": ["w"]}, []),
        ("assign", {"keys": ["w"]}, [w]),
        ("add", {"keys": ["w"]}, [w]),
        ("apply", {"keys": ["w"], "group_of": [0], "optimizers": [sgd]}, [w]),
        ("opt_read", {"keys": ["w"]}, []),
        ("opt_assign", {"keys": ["w"], "states": [["momentum_buffer"]], "optimizer": sgd}, [w]),
    ]


def _paths(value, prefix=()):
    """Every path into a JSON value (dict keys and list indices), the value's own first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _replaced(value, path, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replaced(value[path[0]], path[1:], new)
    return copy


@pytest.fixture(scope="module")
def _optimizer_step_taken():
    # torch's first optimizer step in a process sets TORCHINDUCTOR_CACHE_DIR: take it before the
    # per-test environment check starts.
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.SGD([p], lr=0.1, momentum=0.9).step()


def test_every_malformed_signed_frame_is_refused_as_invalid_naming_the_field(_optimizer_step_taken):
    from phalanx.ps import wire
    from phalanx.ps.transport import ServiceError
    from phalanx.ps.variable_server import ParameterServerService

    service = ParameterServerService(0, SECRET)
    signer = wire.Signer(SECRET, "chief:0")

    def call(method, header, tensors):
        try:
            list(service.handle(method, signer.encode(method, header, tensors).chunks(), "test"))
            return "ok", ""
        except ServiceError as e:
            return e.code, e.detail
        except Exception as e:  # noqa: BLE001 - what gRPC would answer UNKNOWN to
            return "UNKNOWN", f"{type(e).__name__}: {e}"

    for method, header, tensors in _requests():  # each request as sent is accepted
        assert call(method, header, tensors)[0] == "ok", (method, call(method, header, tensors))
    bad, tried = [], 0
    for method, header, tensors in _requests():
        for path in list(_paths(header))[1:]:
            for value in WRONG:
                tried += 1
                code, detail = call(method, _replaced(header, path, value), tensors)
                if code not in ("ok", "invalid", "not_found"):
                    bad.append(f"{method} {path}={value!r}: {code} {detail}")
                elif code == "invalid" and not any(str(p) in detail for p in path if isinstance(p, str)):
                    bad.append(f"{method} {path}={value!r}: the message names no field: {detail}")
                call("create", {"vars": [{"key": "w", "trainable": True}]}, [torch.zeros(4)])
    # A dimension that is JSON true (a bool is an int in Python) or a float, in the frame's own parts.
    for shape in ([True], [False, 4], [4.0], [2**70]):
        frame = _frame_with_shape(signer, shape)
        try:
            list(service.handle("assign", frame, "test"))
            code, detail = "ok", ""
        except ServiceError as e:
            code, detail = e.code, e.detail
        except Exception as e:  # noqa: BLE001
            code, detail = "UNKNOWN", f"{type(e).__name__}: {e}"
        tried += 1
        if code != "invalid" or "shape" not in detail:
            bad.append(f"shape {shape!r}: {code} {detail}")
    print(f"\n{tried} malformed signed frames; {len(bad)} not refused as INVALID_ARGUMENT naming the field")
    assert not bad, "\n".join(bad[:20])


def _frame_with_shape(signer, shape) -> list[bytes]:
    """A signed ``assign`` frame whose one tensor part declares ``shape`` (the 16 bytes of 4 float32 follow)."""
    from phalanx.ps import wire

    header = json.dumps({"keys": ["w"], "parts": [["t", "float32", shape]]}).encode()
    prefix = struct.pack("<II", len(header), 0) + header
    body = prefix + bytes(-len(prefix) % 16) + torch.zeros(4).numpy().tobytes()
    return list(wire.Frame(signer, "assign", [body], len(body), None).chunks())
