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
# jupyter_client imports ipykernel.kernelspec when it starts its first kernel; ipykernel 6 imports
# debugpy there, which sets PYDEVD_USE_FRAME_EVAL in this (the test) process. Imported before any
# test, so the hygiene fixture does not take that for a variable the test leaked.
pytest.importorskip("ipykernel.kernelspec")

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

# A model built before the strategy, as the seed notebook does, on the replicas' device (the CPU):
# Keras draws initial weights from the current device's generator, and on a GPU machine a CUDA
# generator gives other numbers than the CPU's for the same seed (plain Keras, with or without phalanx).
with keras.device("cpu"):
    reference = build()
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

    def __init__(self, tmp: Path, stderr=None, **env: str) -> None:
        self.km = jupyter_client.KernelManager(kernel_name="python3")
        full_env = {
            **os.environ,
            "PHALANX_LOG_ROOT": str(tmp / "logs"),
            "OMP_NUM_THREADS": "1",
            "KERAS_BACKEND": "torch",
            **env,
        }
        full_env.pop("PYTEST_CURRENT_TEST", None)
        self.km.start_kernel(env=full_env, **({"stderr": stderr} if stderr is not None else {}))
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 120, on_output=None) -> dict:
        """Runs one cell; returns its status, stdout, stderr, error and how long it took."""
        # stop_on_error=False: every cell's status is checked here. With the default, ipykernel 6
        # aborts a request that arrives within moments of a failed cell (a person is never that fast).
        msg_id = self.kc.execute(textwrap.dedent(code), stop_on_error=False)
        out = {"stdout": "", "stderr": "", "error": None, "results": [], "start": time.monotonic()}
        deadline = time.monotonic() + timeout
        while True:
            try:
                # In slices of a second: a kernel that died fails the test now, not at the timeout.
                msg = self.kc.get_iopub_msg(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                if not self.km.is_alive():
                    raise AssertionError(f"the kernel died running: {code[:200]}\n{out}") from None
                if time.monotonic() < deadline:
                    continue
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


def test_notebook_replica_that_dies_at_start_fails_the_cell_at_once(tmp_path):
    """A forked replica that cannot become a replica: the strategy's cell fails with its traceback.

    On IPython 9 the colour setting of the replica's shell used to raise in the fork: the child
    went back into the kernel's request handler, wrote to the kernel's ZMQ sockets ("attempted to
    send message from fork"), and replica 0 waited out the 120 s rendezvous timeout with a hint
    about networking. Now the child dies into its log, and replica 0 stops waiting at once.
    """
    kernel_log = tmp_path / "kernel.log"
    with open(kernel_log, "wb") as log:
        kernel = Kernel(tmp_path, stderr=log, PHALANX_RENDEZVOUS_TIMEOUT="100")
    try:
        kernel.ok("import torch, phalanx, phalanx.interactive.replica as replica_module")
        kernel.ok(
            "quiet_shell = replica_module.quiet_shell\n"
            "def broken(shell):\n"
            "    raise RuntimeError('replica set-up broke here')\n"
            "replica_module.quiet_shell = broken"
        )
        failed = kernel.run(STRATEGY, timeout=60)
        took = failed["end"] - failed["start"]
        assert failed["status"] == "error" and failed["error"][0] == "ReplicaCellError", failed
        assert took < 20, f"the dead replica was waited for {took:.1f} s"
        assert "replica set-up broke here" in failed["error"][1], failed["error"]
        assert "while the strategy was being created" in failed["error"][1], failed["error"]
        # Shown once: in the cell's traceback (whose last line is the message), not on stderr too.
        shown = failed["stderr"] + failed["error"][2]
        assert shown.count("RuntimeError: replica set-up broke here") == 1, shown
        assert "RendezvousTimeoutError" not in failed["stderr"] + failed["error"][1]
        # The notebook goes on: a new strategy starts new replicas and works.
        kernel.ok("replica_module.quiet_shell = quiet_shell")
        kernel.ok(STRATEGY)
        result = kernel.ok("strategy.reduce('sum', strategy.run(lambda: torch.ones(1)), axis=None)")
        assert "tensor([2.])" in result["results"][0]
        kernel.ok("strategy.close()")
    finally:
        kernel.shutdown()
    text = kernel_log.read_text(errors="replace")
    assert "send message from fork" not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


RACE_IN_A_LOOP = """
delay_0, delay_1 = {delay_0}, {delay_1}
for step in range(6):
    def fn():
        if phalanx.interactive.replica_id() == 1 and step == 3:
            time.sleep(delay_1)
            raise ValueError('bad record in shard 1 at step 3')
        return torch.ones(1)
    time.sleep(delay_0 if step == 3 else 0)
    strategy.reduce('sum', strategy.run(fn), axis=None)
"""
RACE_WITHOUT_COLLECTIVE = """
if phalanx.interactive.replica_id() == 1:
    time.sleep({delay_1})
    raise ValueError('bad record in shard 1 at step 3')
time.sleep({delay_0})
"""


def test_notebook_root_cause_is_shown_once_whatever_the_order(tmp_path):
    """An error on replica 1 fails the cell with that error, once, 50 times out of 50.

    Half the runs raise inside a training loop, where replica 0 waits for replica 1 in a collective
    it will never join (before, it waited there until the collective timeout, 300 s); half raise in
    a cell without collectives, with replica 0 finishing first or last (random delays on both).
    """
    import random

    rng = random.Random(0)
    kernel = Kernel(tmp_path)
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    try:
        kernel.ok("import time, torch, phalanx")
        need_strategy, outcomes = True, []
        for run in range(50):
            if need_strategy:
                kernel.ok(STRATEGY)
            in_loop = run % 2 == 0
            cell = RACE_IN_A_LOOP if in_loop else RACE_WITHOUT_COLLECTIVE
            cell = cell.format(delay_0=round(rng.uniform(0, 0.3), 3), delay_1=round(rng.uniform(0, 0.3), 3))
            failed = kernel.run(cell, timeout=60)
            took = failed["end"] - failed["start"]
            shown = ansi.sub("", failed["stderr"] + (failed["error"][2] if failed["error"] else ""))
            outcomes.append((run, failed["status"], failed["error"] and failed["error"][0], round(took, 2)))
            assert failed["status"] == "error" and failed["error"][0] == "ReplicaCellError", (run, failed)
            assert shown.count("ValueError: bad record in shard 1 at step 3") == 1, (run, shown)
            assert took < 10, (run, took)
            # A replica interrupted in a collective leaves the replicas out of step: the session ends
            # (and says so at the next cell); without a collective it goes on.
            need_strategy = in_loop
        assert len(outcomes) == 50
    finally:
        kernel.shutdown()


SHARDED = """
import torch, phalanx
torch.manual_seed(0)
def build():
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
X, Y = torch.randn(64, 20), torch.randn(64, 4)
reference = build()
with torch.no_grad():
    reference_start = [p.clone() for p in reference.parameters()]
opt = torch.optim.Adam(reference.parameters(), lr=0.01)
for i in range(0, 64, 16):
    ((reference(X[i:i+16]) - Y[i:i+16]) ** 2).sum().div(16).backward(); opt.step(); opt.zero_grad()

def train(strategy):
    with strategy.scope():
        model = build()
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference_start):
                p.copy_(q)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    def step(x, y):
        loss = phalanx.nn.compute_average_loss(((model(x) - y) ** 2).sum(1), global_batch_size=16)
        loss.backward(); opt.step(); opt.zero_grad()
        return loss
    batches = [(X[i:i+16], Y[i:i+16]) for i in range(0, 64, 16)]
    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x, y))
    whole = [p.full_tensor() for p in model.parameters()]  # a collective: every replica takes part
    return max(float((a - b).abs().max()) for a, b in zip(whole, reference.parameters()))
"""


def test_notebook_fully_sharded_strategy_trains_and_a_second_one_reuses_the_session(tmp_path):
    """FullyShardedStrategy in a real kernel: its replicas shard the model built in a cell and train
    like one device; closed, it gives back the default process group it made, so a second one in
    the same session makes its own."""
    kernel = Kernel(tmp_path)
    try:
        kernel.ok(SHARDED, timeout=120)
        for name in ("first", "second"):
            out = kernel.ok(
                f"{name} = phalanx.FullyShardedStrategy(['cpu:0', 'cpu:1'], min_params_to_shard=16)\n"
                f"print('WORST', train({name}), phalanx.interactive.num_replicas())\n"
                f"{name}.close()\n"
                "print('GROUP', torch.distributed.is_initialized())",
                timeout=180,
            )
            assert out["stdout"].count("WORST") == 1, out  # replica 0's output only
            worst, replicas = re.search(r"WORST (\S+) (\d)", out["stdout"]).groups()
            assert float(worst) < 1e-5 and replicas == "2", out["stdout"]
            assert "GROUP False" in out["stdout"], out["stdout"]
    finally:
        kernel.shutdown()


def test_notebook_progress_bar_is_drawn_once_by_the_kernel(tmp_path):
    """phalanx.progress in a notebook: the kernel (the chief) draws one bar; its replica prints nothing."""
    kernel = Kernel(tmp_path)
    try:
        kernel.ok("import torch, phalanx\n" + STRATEGY, timeout=180)
        shown = kernel.ok(
            "bar = phalanx.progress(strategy.experimental_distribute_dataset([torch.ones(8, 2)] * 4), desc='nbbar')\n"
            "for x in bar:\n"
            "    loss = strategy.reduce('sum', strategy.run(lambda t: t.sum(), args=(x,)), axis=None)\n"
            "    bar.set_postfix(loss=loss)\n"
            "print('style', bar.style, 'chief', bar.chief)"
        )
        assert "style tqdm chief True" in shown["stdout"], shown
        assert shown["stderr"].count("nbbar") >= 1 and "4/4" in shown["stderr"], shown
        assert "loss=16" in shown["stderr"], shown
        # Replica 1 ran the same cell; what it prints goes to its log: no bar there.
        kernel.ok("if phalanx.interactive.replica_id() == 1:\n    print('replica 1 was here', flush=True)")
        logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").rglob("*.log"))
        assert "replica 1 was here" in logs and "nbbar" not in logs, logs[-2000:]
    finally:
        kernel.shutdown()
