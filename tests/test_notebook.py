"""Multi-replica strategies in a real Jupyter kernel (ipykernel, driven by jupyter_client), cell by cell.

One kernel per test (the hygiene fixture wants no process left between tests), several checks
per kernel: the replicas took part, output appears once, the fit equals one-device Keras, an
error on replica 1 only fails its cell, an interrupt during fit stops every replica in step, a
killed replica is reported and the notebook goes on, and the shutdown leaves no process and no
/dev/shm segment.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import textwrap
import time
from pathlib import Path

import psutil
import pytest

jupyter_client = pytest.importorskip("jupyter_client")

TOL = 1e-5
SETUP = """
import json, os, time
import numpy as np, torch, keras, phalanx, phalanx.keras
OUT = {out!r}
rng = np.random.default_rng(0)
X = rng.normal(size=(256, 20)).astype("float32")
Y = rng.integers(0, 4, size=256)

def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dropout(0.0), keras.layers.Dense(4, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model

def record(name, model):
    rid = phalanx.interactive.replica_id()
    with open(os.path.join(OUT, f"{{name}}_{{rid}}.json"), "w") as f:
        json.dump({{"pid": os.getpid(), "replicas": phalanx.interactive.num_replicas(),
                   "weights": [w.tolist() for w in model.get_weights()]}}, f)

reference = build()   # a model built before the strategy, as the seed notebook does
h_ref = reference.fit(X, Y, epochs=3, batch_size=32, shuffle=False, verbose=0)
e_ref = reference.evaluate(X, Y, batch_size=32, verbose=0)
"""
STRATEGY = "strategy = phalanx.MirroredStrategy(['cpu:0', 'cpu:1'])"
FIT = """
with strategy.scope():
    model = build()
h = model.fit(X, Y, epochs=3, batch_size=32, shuffle=False, verbose=2)
e = model.evaluate(X, Y, batch_size=32, verbose=0)
record("fit", model)
worst = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights()))
worst = max([worst] + [abs(a - b) for k in h_ref.history for a, b in zip(h.history[k], h_ref.history[k])]
            + [abs(a - b) for a, b in zip(e, e_ref)])
print("WORST", worst)
"""


class Kernel:
    """A real ipykernel with helpers to run a cell and collect what the notebook would show."""

    def __init__(self, tmp: Path, **env: str) -> None:
        self.km = jupyter_client.KernelManager(kernel_name="python3")
        full_env = {
            **os.environ,
            "PHALANX_LOG_ROOT": str(tmp / "logs"),
            "OMP_NUM_THREADS": "1",
            "KERAS_BACKEND": "torch",
            **env,
        }
        full_env.pop("PYTEST_CURRENT_TEST", None)
        self.km.start_kernel(env=full_env)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 120, on_output=None) -> dict:
        """Runs one cell; returns its status, stdout, stderr, error and how long it took."""
        msg_id = self.kc.execute(textwrap.dedent(code))
        out = {"stdout": "", "stderr": "", "error": None, "results": [], "start": time.monotonic()}
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"cell did not finish in {timeout} s: {code[:200]}\n{out}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
                if on_output is not None:
                    on_output(out)
            elif kind == "error":
                out["error"] = (content["ename"], content["evalue"], "\n".join(content["traceback"]))
            elif kind == "execute_result":
                out["results"].append(content["data"].get("text/plain", ""))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        out["end"] = time.monotonic()
        while True:
            reply = self.kc.get_shell_msg(timeout=10)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        out["status"] = reply["content"]["status"]
        return out

    def ok(self, code: str, timeout: float = 120) -> dict:
        out = self.run(code, timeout)
        assert out["status"] == "ok", f"cell failed: {out['error']}\nstderr: {out['stderr']}"
        return out

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _replica_pids(out: Path, name: str) -> dict[int, int]:
    return {int(p.stem.rsplit("_", 1)[1]): json.loads(p.read_text())["pid"] for p in out.glob(f"{name}_*.json")}


def _gone(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    return alive


def _check_fit(kernel: Kernel, out: Path) -> None:
    fit = kernel.ok(FIT)
    # Output once: replica 0's per-epoch lines only (replica 1's go to its log).
    for epoch in (1, 2, 3):
        assert fit["stdout"].count(f"Epoch {epoch}/3") == 1, fit["stdout"]
    worst = float(re.search(r"WORST (\S+)", fit["stdout"]).group(1))
    assert worst <= TOL, f"Mirrored(2 CPU) in a notebook differs from one device by {worst}"
    records = {r: json.loads((out / f"fit_{r}.json").read_text()) for r in (0, 1)}
    assert sorted(records) == [0, 1] and all(rec["replicas"] == 2 for rec in records.values())
    assert records[0]["pid"] != records[1]["pid"]
    assert records[0]["weights"] == records[1]["weights"], "replicas diverged"


def test_notebook_fork_session(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shm_before = _shm()
    kernel = Kernel(tmp_path)
    try:
        kernel.ok(SETUP.format(out=str(out)), timeout=180)
        started = kernel.ok(STRATEGY)
        assert started["stderr"].count("phalanx: started replicas 1..1") == 1
        assert str(tmp_path / "logs") in started["stderr"]  # says where the others' output goes
        _check_fit(kernel, out)

        # A shell escape runs once: on replica 0 only.
        marker = out / "escape.txt"
        kernel.ok(f"!echo x >> {marker}")
        assert marker.read_text() == "x\n"

        # An error on replica 1 only fails the cell with replica 1's traceback; the session goes on.
        err = kernel.run("if phalanx.interactive.replica_id() == 1:\n    raise ValueError('only on replica 1')")
        assert err["status"] == "error" and err["error"][0] == "ReplicaCellError", err
        assert "only on replica 1" in err["error"][1] and "replica 1" in err["error"][1]
        assert (
            "tensor([2.])"
            in kernel.ok("strategy.reduce('sum', strategy.run(lambda: torch.ones(1)), axis=None)")["results"][0]
        )

        # Interrupt during fit: every replica stops at the same step within 2 s, and fits again.
        sent = {}

        def interrupt_at_epoch_2(o):
            if "sent" not in sent and "Epoch 2/" in o["stdout"]:
                sent["sent"] = time.monotonic()
                kernel.km.interrupt_kernel()

        stopped = kernel.run("model.fit(X, Y, epochs=1000, batch_size=32, verbose=2)", on_output=interrupt_at_epoch_2)
        assert "sent" in sent and stopped["status"] == "error" and stopped["error"][0] == "InterruptedAtStep", stopped
        assert stopped["end"] - sent["sent"] < 2.0, f"interrupt took {stopped['end'] - sent['sent']:.2f} s"
        kernel.ok("model.fit(X, Y, epochs=1, batch_size=32, verbose=0); record('after_interrupt', model)")
        after = [json.loads((out / f"after_interrupt_{r}.json").read_text())["weights"] for r in (0, 1)]
        assert after[0] == after[1], "replicas out of step after an interrupt"

        # A killed replica is reported within 2 s; the notebook stays usable.
        pids = _replica_pids(out, "fit")
        killed = {}

        def kill_at_epoch_2(o):
            if "at" not in killed and "Epoch 2/" in o["stdout"]:
                killed["at"] = time.monotonic()
                os.kill(pids[1], signal.SIGKILL)
            if "at" in killed and "reported" not in killed and f"replica 1 (pid {pids[1]})" in o["stderr"]:
                killed["reported"] = time.monotonic()

        dead = kernel.run("model.fit(X, Y, epochs=1000, batch_size=32, verbose=2)", on_output=kill_at_epoch_2)
        assert dead["status"] == "error", dead
        assert "reported" in killed and killed["reported"] - killed["at"] < 2.0, (
            f"a dead replica took {killed.get('reported', dead['end']) - killed['at']:.2f} s to be reported"
        )
        assert dead["error"][0] in ("ReplicaCellError", "PeerUnavailableError"), dead["error"]
        gone = kernel.ok("print('still here')")
        assert "still here" in gone["stdout"] and "replicas are gone" in gone["stderr"]
        assert not _gone([pids[1]], 1)
        # A new strategy starts new replicas.
        kernel.ok(STRATEGY)
        kernel.ok("record('second', model)")
        pids2 = _replica_pids(out, "second")
        assert sorted(pids2) == [0, 1] and pids2[1] != pids[1]
        assert (
            "tensor([2.])"
            in kernel.ok("strategy.reduce('sum', strategy.run(lambda: torch.ones(1)), axis=None)")["results"][0]
        )
    finally:
        kernel_pid = kernel.km.provisioner.process.pid if kernel.km.provisioner else None
        kernel.shutdown()
    # Shutdown leaves no replica and no shared-memory segment.
    assert not _gone([kernel_pid, *pids2.values()]), "processes left after kernel shutdown"
    assert not {f for f in _shm() - shm_before if "phalanx" in f or "torch" in f}


def test_notebook_spawn_session_matches_one_device(tmp_path):
    """The non-fork path (forced here; CUDA-initialised kernels take it): replicas replay the history."""
    out = tmp_path / "out"
    out.mkdir()
    kernel = Kernel(tmp_path, PHALANX_INTERACTIVE_START="spawn")
    try:
        kernel.ok(SETUP.format(out=str(out)), timeout=180)
        started = kernel.ok(STRATEGY, timeout=180)
        assert "(spawn)" in started["stderr"]
        _check_fit(kernel, out)
        pids = _replica_pids(out, "fit")
        # A second strategy reuses the session's replica, with its own process group.
        second = kernel.ok(
            "second = phalanx.MirroredStrategy(['cpu:0', 'cpu:1'])\n"
            "second.reduce('sum', second.run(lambda: torch.ones(1) * 3), axis=None)"
        )
        assert "tensor([6.])" in second["results"][0] and "started replicas" not in second["stderr"]
        kernel.ok("second.close(); strategy.close()")
        assert not _gone([pids[1]], 5), "strategy.close() left the replica running"
        assert "replicas" not in kernel.ok("print(1)")["stderr"]
        # A new session replays a history holding the earlier sessions' strategies: those are skipped.
        kernel.ok(STRATEGY + "\nrecord('third', reference)", timeout=180)
        third = _replica_pids(out, "third")
        assert sorted(third) == [0, 1] and third[1] != pids[1]
        assert (
            "tensor([2.])"
            in kernel.ok("strategy.reduce('sum', strategy.run(lambda: torch.ones(1)), axis=None)")["results"][0]
        )
    finally:
        kernel.shutdown()
