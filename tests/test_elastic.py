"""An elastic job loses replicas and goes on (``phalanx run --min-nproc``; phalanx.comm.elastic).

Real jobs: ``phalanx run`` (or TF_CONFIG tasks started by hand) with CPU replicas on loopback, one
replica killed with SIGKILL mid-training. What is checked is what the user relies on: the job
ends rc 0 after all its steps, every example of every global batch is trained on exactly once
(the lost replica's share taken by the survivors from the step it died in), the survivors hold
bit-identical weights, and those weights are the one-device run's (up to float summation order).
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_slurm_requeue import DEPLOY, slurm  # noqa: F401  (a real one-node Slurm cluster)

from conftest import free_ports, run_job, run_jobs, tf_config

STEPS, BATCH, KILL_AT = 40, 24, 30  # the case: replica 2 killed at step 30

# The program of the custom-loop tests: each replica records, per step, the example ids it
# trained on in the attempt that counted and the group's size, its final weights, and what
# phalanx told it about the group's changes. MEMBER is its rank at the start.
TRAIN = f"""
    import json, os, signal, sys
    import torch
    import phalanx as px

    member = int(os.environ.get("MEMBER") or os.environ["PHALANX_RANK"])
    kill = int(os.environ.get("KILL_MEMBER", "-1"))
    torch.manual_seed(0)
    strategy = px.MultiWorkerMirroredStrategy() if os.environ.get("MWMS") else px.MirroredStrategy()
    changes = []
    px.on_membership_change(lambda c: changes.append(
        {{"step": c.step, "lost": list(c.lost), "after": len(c.after), "now": strategy.num_replicas_in_sync}}))
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    n = {BATCH} * {STEPS}
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))
    loader = torch.utils.data.DataLoader(data, batch_size={BATCH})
    seen = {{}}

    def step_fn(x, y, ids):
        seen[strategy.extended.step] = {{"ids": ids.tolist(), "n": strategy.num_replicas_in_sync}}
        loss = px.nn.compute_average_loss(((model(x) - y) ** 2).sum(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    for i, (x, y, ids) in enumerate(strategy.experimental_distribute_dataset(loader)):
        if i + 1 == {KILL_AT} and member == kill:
            if os.environ.get("RAISE"):
                raise RuntimeError("boom in the step of replica " + str(member))
            os.kill(os.getpid(), signal.SIGKILL)
        loss = strategy.reduce("SUM", strategy.run(step_fn, args=(x, y, ids)), axis=None)
    json.dump({{"seen": seen, "changes": changes, "world": strategy.num_replicas_in_sync,
               "weights": [p.detach().tolist() for p in model.parameters()]}}, open(f"out_{{member}}.json", "w"))
"""


ONE_DEVICE = f"""
    import json
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    n = {BATCH} * {STEPS}
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
    for i in range({STEPS}):
        xb, yb = x[i * {BATCH} : (i + 1) * {BATCH}], y[i * {BATCH} : (i + 1) * {BATCH}]
        loss = ((model(xb) - yb) ** 2).sum() / {BATCH}
        opt.zero_grad()
        loss.backward()
        opt.step()
    json.dump([p.detach().tolist() for p in model.parameters()], open("one_device.json", "w"))
"""


def one_device(tmp_path: Path, script, body: str, out: str) -> list:
    """The same training on one device, in a process of its own: what every survivor must hold."""
    res = run_job([sys.executable, str(script(body, name="one_device.py"))], timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.output
    return json.loads((tmp_path / out).read_text())


def check_survivors(tmp_path: Path, script, survivors: list[int], lost: int, replicas: int) -> None:
    outs = {m: json.loads((tmp_path / f"out_{m}.json").read_text()) for m in survivors}
    assert not (tmp_path / f"out_{lost}.json").exists()
    for m, out in outs.items():
        assert out["world"] == len(survivors), (m, out["world"])
        # Told once, between the abandoned attempt of step KILL_AT and its new one.
        assert [(c["step"], c["after"], c["now"]) for c in out["changes"]] == [
            (KILL_AT, len(survivors), len(survivors))
        ]
        assert len(out["changes"][0]["lost"]) == 1 and f"{lost}" in out["changes"][0]["lost"][0], out["changes"]
        assert sorted(int(s) for s in out["seen"]) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        sizes = {outs[m]["seen"][str(step)]["n"] for m in survivors}
        assert sizes == {replicas if step < KILL_AT else len(survivors)}, (step, sizes)
        if step >= KILL_AT:  # every example of the global batch once, among the survivors
            ids = sorted(i for m in survivors for i in outs[m]["seen"][str(step)]["ids"])
            assert ids == list(range((step - 1) * BATCH, step * BATCH)), (step, ids)
    first = [torch.tensor(w) for w in outs[survivors[0]]["weights"]]
    for m in survivors[1:]:
        assert all(torch.equal(a, torch.tensor(b)) for a, b in zip(first, outs[m]["weights"])), m
    for a, b in zip(first, one_device(tmp_path, script, ONE_DEVICE, "one_device.json")):
        assert torch.allclose(a, torch.tensor(b), rtol=1e-5, atol=1e-5), (a, b)


def elastic_run(
    tmp_path: Path,
    script,
    *args: str,
    env: dict[str, str],
    timeout: float = 150,
    body: str = TRAIN,
    fresh: bool = False,
) -> object:
    """``phalanx run ARGS job.py`` with ``body`` as the job (a CUDA job: ``fresh``, never forked)."""
    job = script(body)
    return run_job(
        [sys.executable, "-m", "phalanx.cli", "run", *args, str(job)],
        timeout=timeout,
        cwd=tmp_path,
        env={"PHALANX_COLLECTIVE_TIMEOUT": "60", **env},
        fresh=fresh,
    )


def test_mirrored_job_loses_replica_2_and_ends_rc0_with_every_example_once(tmp_path, script):
    res = elastic_run(tmp_path, script, "-n", "3", "--min-nproc", "2", env={"KILL_MEMBER": "2"})
    assert res.returncode == 0, res.logs()
    assert "replica 2 was lost (killed by SIGKILL); the job goes on with 2 replica(s)" in res.output, res.output
    check_survivors(tmp_path, script, [0, 1], lost=2, replicas=3)


def test_multi_worker_job_over_gloo_loses_replica_0(tmp_path, script):
    # Replica 0 (the chief, whose output is the terminal) goes: the launcher serves the store, and
    # gloo (no shared memory) carries the collectives; the survivors renumber from 0.
    res = elastic_run(
        tmp_path, script, "-n", "3", "--min-nproc", "2", env={"KILL_MEMBER": "0", "MWMS": "1", "PHALANX_SHM": "0"}
    )
    assert res.returncode == 0, res.logs()
    assert "replica 0 was lost" in res.output, res.output
    check_survivors(tmp_path, script, [1, 2], lost=0, replicas=3)


def test_tf_config_job_started_by_hand_loses_a_worker(tmp_path, script):
    # No launcher: the chief serves the store (a job that loses its chief ends, docs/elastic.md).
    job = script(TRAIN)
    workers = [f"127.0.0.1:{p}" for p in free_ports(3)]
    env = {"MWMS": "1", "PHALANX_MIN_NPROC": "2", "KILL_MEMBER": "2", "PHALANX_COLLECTIVE_TIMEOUT": "60"}
    results = run_jobs(
        [([sys.executable, str(job)], {**tf_config(workers, i), **env, "MEMBER": str(i)}) for i in range(3)],
        timeout=150,
        cwd=tmp_path,
    )
    assert [r.returncode for r in results][:2] == [0, 0], [r.output[-3000:] for r in results]
    assert results[2].returncode == -9
    check_survivors(tmp_path, script, [0, 1], lost=2, replicas=3)


def test_fewer_survivors_than_the_minimum_end_the_job_naming_the_lost_replica(tmp_path, script):
    res = elastic_run(tmp_path, script, "-n", "2", "--min-nproc", "2", env={"KILL_MEMBER": "1"}, timeout=90)
    assert res.returncode != 0
    assert "root cause" in res.output and "replica 1" in res.output and "SIGKILL" in res.output, res.output
    assert "goes on" not in res.output
    assert res.elapsed < 60


def test_a_replica_whose_program_raises_fails_the_job_as_without_min_nproc(tmp_path, script):
    # An error in the program would repeat on the survivors: only a lost process is healed.
    res = elastic_run(tmp_path, script, "-n", "3", "--min-nproc", "2", env={"KILL_MEMBER": "2", "RAISE": "1"})
    assert res.returncode != 0
    assert "boom in the step of replica 2" in res.output and "root cause" in res.output, res.output
    assert "goes on" not in res.output


def test_a_strategy_that_cannot_go_on_without_a_replica_refuses_min_nproc(tmp_path, script):
    job = script("""
        import phalanx as px
        px.experimental.CentralStorageStrategy()
    """)
    res = run_job(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", "--min-nproc", "1", str(job)], timeout=90, cwd=tmp_path
    )
    assert res.returncode != 0
    assert "ClusterSpecError" in res.output and "PHALANX_MIN_NPROC" in res.output, res.output
    assert "CentralStorageStrategy cannot go on without a lost replica" in res.output, res.output


@pytest.mark.parametrize("args", [["-n", "2", "--min-nproc", "3"], ["--ps", "1", "--workers", "2", "--min-nproc", "1"]])
def test_phalanx_run_refuses_a_minimum_it_cannot_keep(tmp_path, args):
    res = run_job([sys.executable, "-m", "phalanx.cli", "run", *args, "train.py"], timeout=60, cwd=tmp_path)
    assert res.returncode == 2
    assert "--min-nproc" in res.output, res.output


KERAS_FIT = f"""
    import json, os, signal
    import numpy as np
    import keras
    import phalanx as px

    member = int(os.environ["PHALANX_RANK"])
    strategy = px.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    x = rng.normal(size=({BATCH} * {STEPS}, 8)).astype("float32")
    y = rng.normal(size=({BATCH} * {STEPS}, 1)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")

    class Watch(keras.callbacks.Callback):
        changes, batches = [], 0

        def on_train_batch_begin(self, batch, logs=None):
            self.batches += 1
            if self.batches == {STEPS} + {KILL_AT} and member == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_membership_change(self, change):
            self.changes.append([change.step, len(change.after), strategy.num_replicas_in_sync])

    watch = Watch()
    history = model.fit(x, y, batch_size={BATCH}, epochs=2, shuffle=False, verbose=0, callbacks=[watch])
    json.dump({{"changes": watch.changes, "loss": history.history["loss"],
               "weights": [w.tolist() for w in model.get_weights()]}}, open(f"keras_{{member}}.json", "w"))
"""


def keras_one_device(steps: int, epochs: int, optimizer: str, shuffle: bool) -> str:
    """The Keras programs' fit on one device (what every member must hold), as a program's text."""
    return f"""
    import json
    import numpy as np
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    x = rng.normal(size=({BATCH} * {steps}, 8)).astype("float32")
    y = rng.normal(size=({BATCH} * {steps}, 1)).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.{optimizer}, loss="mse")
    model.fit(x, y, batch_size={BATCH}, epochs={epochs}, shuffle={shuffle}, verbose=0)
    json.dump([w.tolist() for w in model.get_weights()], open("keras_one_device.json", "w"))
"""


KERAS_ONE_DEVICE = keras_one_device(STEPS, 2, "SGD(0.05, momentum=0.9)", shuffle=False)


def test_keras_fit_under_multi_worker_goes_on_and_its_callbacks_see_the_change(tmp_path, script):
    import numpy as np

    res = elastic_run(
        tmp_path, script, "-n", "3", "--min-nproc", "2", env={"KERAS_BACKEND": "torch"}, timeout=200, body=KERAS_FIT
    )
    assert res.returncode == 0, res.logs()
    outs = [json.loads((tmp_path / f"keras_{m}.json").read_text()) for m in (0, 1)]
    assert not (tmp_path / "keras_2.json").exists()
    step = STEPS + KILL_AT  # the second epoch's step KILL_AT
    assert [o["changes"] for o in outs] == [[[step, 2, 2]]] * 2
    assert outs[0]["loss"] == outs[1]["loss"]
    assert all(np.array_equal(a, b) for a, b in zip(outs[0]["weights"], outs[1]["weights"]))
    # The same fit on one device: the global batch was the same at every step.
    reference = one_device(tmp_path, script, KERAS_ONE_DEVICE, "keras_one_device.json")
    for a, b in zip(outs[0]["weights"], reference):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


# A replacement joins: phalanx run starts one for the lost replica; it runs the program from the
# top and joins at a step boundary with replica 0's state (Adam's moments included: the one-device
# comparison fails if they were not sent). The members slow down while they wait for it, so that it
# joins before the data ends however loaded the machine is.
JOIN = f"""
    import json, os, signal, time
    import torch
    import phalanx as px

    member = int(os.environ.get("PHALANX_JOIN_AS") or os.environ.get("MEMBER") or os.environ["PHALANX_RANK"])
    if os.environ.get("PHALANX_JOIN_AS") and os.environ.get("WAIT_FOR"):
        while not os.path.exists(os.environ["WAIT_FOR"]):
            time.sleep(0.05)
    torch.manual_seed(0)
    # RING: gloo, which shares one GPU between replica processes (tests/test_gpu.py).
    options = px.CommunicationOptions(implementation=px.CommunicationImplementation.RING) if os.environ.get("RING") else None
    strategy = px.MultiWorkerMirroredStrategy(communication_options=options) if os.environ.get("MWMS") else px.MirroredStrategy()
    changes = []
    px.on_membership_change(lambda c: changes.append(
        {{"step": c.step, "lost": len(c.lost), "joined": list(c.joined), "now": strategy.num_replicas_in_sync}}))
    width = 64 if os.environ.get("PHALANX_JOIN_AS") and os.environ.get("OTHER_MODEL") else 32
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    n = {BATCH} * {STEPS * 4}
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))
    loader = torch.utils.data.DataLoader(data, batch_size={BATCH})
    seen = {{}}

    def step_fn(x, y, ids):
        seen[strategy.extended.step] = {{"ids": ids.tolist(), "n": strategy.num_replicas_in_sync}}
        loss = px.nn.compute_average_loss(((model(x) - y) ** 2).sum(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    waited = 0.0
    for i, (x, y, ids) in enumerate(strategy.experimental_distribute_dataset(loader)):
        if i + 1 == {KILL_AT} and member == 2:
            open("lost", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        strategy.reduce("SUM", strategy.run(step_fn, args=(x, y, ids)), axis=None)
        if strategy.extended.step > {KILL_AT} and strategy.num_replicas_in_sync < 3 and waited < 15:
            time.sleep(0.1)
            waited += 0.1
    json.dump({{"seen": seen, "changes": changes, "world": strategy.num_replicas_in_sync,
               "device": str(next(model.parameters()).device),
               "weights": [p.detach().tolist() for p in model.parameters()]}}, open(f"join_{{member}}.json", "w"))
"""

JOIN_ONE_DEVICE = (
    ONE_DEVICE.replace(
        "torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)", "torch.optim.Adam(model.parameters(), lr=0.01)"
    )
    .replace(f"range({STEPS})", f"range({STEPS * 4})")
    .replace(f"n = {BATCH} * {STEPS}", f"n = {BATCH} * {STEPS * 4}")
)


def check_rejoined(tmp_path: Path, script, members: list[int], joiner: int, *, tol: float = 1e-5) -> None:
    """The group shrank at KILL_AT and grew back when ``joiner`` joined; every example once among
    those there; the members' weights equal, and equal to the one-device run's (within ``tol``)."""
    steps = STEPS * 4
    outs = {m: json.loads((tmp_path / f"join_{m}.json").read_text()) for m in members}
    for m, out in outs.items():
        assert out["world"] == 3, (m, out["world"], out["changes"])
    first = min(int(s) for s in outs[joiner]["seen"])
    for m in members:
        if m != joiner:  # shrank at KILL_AT, grew back when the replacement joined
            assert [(c["step"], c["lost"], c["now"]) for c in outs[m]["changes"]] == [(KILL_AT, 1, 2), (first, 0, 3)]
            assert outs[m]["changes"][1]["joined"] == [f"replica:{joiner}"], outs[m]["changes"]
    assert [(c["step"], c["joined"]) for c in outs[joiner]["changes"]] == [(first, [f"replica:{joiner}"])]
    assert KILL_AT < first < steps, first
    for step in range(KILL_AT, steps + 1):  # every example once, among those there
        ids = sorted(i for m in members for i in outs[m]["seen"].get(str(step), {}).get("ids", []))
        assert ids == list(range((step - 1) * BATCH, step * BATCH)), (step, ids)
        there = [m for m in members if str(step) in outs[m]["seen"]]
        assert len(there) == (3 if step >= first else 2), (step, there)
    weights = [[torch.tensor(w) for w in outs[m]["weights"]] for m in members]
    assert all(torch.equal(a, b) for other in weights[1:] for a, b in zip(weights[0], other))
    for a, b in zip(weights[0], one_device(tmp_path, script, JOIN_ONE_DEVICE, "one_device.json")):
        assert torch.allclose(a, torch.tensor(b), rtol=tol, atol=tol), (a, b)


def test_a_replacement_joins_with_a_live_replicas_state_and_the_group_is_back_to_3(tmp_path, script):
    res = elastic_run(tmp_path, script, "-n", "3", "--min-nproc", "2", env={}, timeout=200, body=JOIN)
    assert res.returncode == 0, res.logs()
    assert "replica 3 started to replace it; it joins at a step boundary" in res.output, res.output
    check_rejoined(tmp_path, script, [0, 1, 3], joiner=3)


def test_a_replacement_with_another_model_is_refused_by_name_and_the_group_goes_on(tmp_path, script):
    res = elastic_run(tmp_path, script, "-n", "3", "--min-nproc", "2", env={"OTHER_MODEL": "1"}, timeout=200, body=JOIN)
    assert res.returncode == 0, res.logs()
    assert "replica 3 could not join: ElasticRecoveryError" in res.output, res.output
    assert "replica:3 was refused: its model differs from the group's (variable 0: [[64, 8]" in res.output, res.output
    outs = [json.loads((tmp_path / f"join_{m}.json").read_text()) for m in (0, 1)]
    assert [o["world"] for o in outs] == [2, 2]


def test_tf_config_job_takes_back_a_replacement_started_by_hand(tmp_path, script):
    # What a cluster manager does: the lost worker's task started again, as a replacement (its id
    # in PHALANX_JOIN_AS), once the worker is gone. The chief serves the store.
    job = script(JOIN)
    workers = [f"127.0.0.1:{p}" for p in free_ports(3)]
    env = {"MWMS": "1", "PHALANX_MIN_NPROC": "2", "PHALANX_COLLECTIVE_TIMEOUT": "60"}
    tasks = [([sys.executable, str(job)], {**tf_config(workers, i), **env, "MEMBER": str(i)}) for i in range(3)]
    replacement = {**tf_config(workers, 2), **env, "PHALANX_JOIN_AS": "3", "WAIT_FOR": str(tmp_path / "lost")}
    results = run_jobs([*tasks, ([sys.executable, str(job)], replacement)], timeout=200, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0, -9, 0], [r.output[-3000:] for r in results]
    check_rejoined(tmp_path, script, [0, 1, 3], joiner=3)


def test_a_replacement_running_another_version_of_the_program_is_refused_by_name(tmp_path, script):
    job = script(JOIN)
    changed = script(JOIN + "    # version 2\n", name="job_v2.py")
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    env = {"MWMS": "1", "PHALANX_MIN_NPROC": "1", "PHALANX_COLLECTIVE_TIMEOUT": "60"}
    tasks = [([sys.executable, str(job)], {**tf_config(workers, i), **env, "MEMBER": str(i + 1)}) for i in range(2)]
    # MEMBER 2 is lost at KILL_AT (the second worker); its replacement runs job_v2.py.
    replacement = {**tf_config(workers, 1), **env, "PHALANX_JOIN_AS": "3", "WAIT_FOR": str(tmp_path / "lost")}
    results = run_jobs([*tasks, ([sys.executable, str(changed)], replacement)], timeout=200, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, -9, 1], [r.output[-3000:] for r in results]
    assert "ElasticRecoveryError" in results[2].output and "replica:3 was refused: its program differs" in (
        results[2].output
    ), results[2].output
    assert json.loads((tmp_path / "join_1.json").read_text())["world"] == 1


# A replacement joins Keras fit: at an epoch boundary (fit on arrays has no input position to catch
# up within an epoch), with replica 0's weights, Adam's slots and step count, the epoch to start at,
# and the random state fit shuffles with. Replica 2 is killed mid-epoch 1; the members slow down
# while the group is short, so that the replacement joins before the last epoch however loaded the
# machine is. The one-device comparison fails if any of those were not sent.
K_STEPS, K_EPOCHS, K_KILL = 10, 12, 5  # steps per epoch, epochs, the batch of epoch 1 replica 2 dies in
KERAS_JOIN = f"""
    import json, os, signal, time
    import numpy as np
    import keras
    import phalanx as px
    import phalanx.keras

    member = int(os.environ.get("PHALANX_JOIN_AS") or os.environ.get("MEMBER") or os.environ["PHALANX_RANK"])
    if os.environ.get("PHALANX_JOIN_AS") and os.environ.get("WAIT_FOR"):
        while not os.path.exists(os.environ["WAIT_FOR"]):
            time.sleep(0.05)
    strategy = px.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    x = rng.normal(size=({BATCH} * {K_STEPS}, 8)).astype("float32")
    y = rng.normal(size=({BATCH} * {K_STEPS}, 1)).astype("float32")
    width = 32 if os.environ.get("PHALANX_JOIN_AS") and os.environ.get("OTHER_MODEL") else 16
    # LAZY: no input shape, so fit builds the model (outside the scope, at its start).
    inputs = [] if os.environ.get("LAZY") else [keras.Input((8,))]
    with strategy.scope():
        model = keras.Sequential([*inputs, keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(1)])
        if os.environ.get("LAZY"):
            phalanx.keras.distribute(model)  # nothing was built in scope
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")

    class Watch(keras.callbacks.Callback):
        changes, epoch, waited = [], None, 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch == 1 and batch == {K_KILL} and member == 2:
                open("lost", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            if strategy.num_replicas_in_sync < 3 and self.waited < float(os.environ.get("WAIT_S", "25")):
                time.sleep(0.25)
                self.waited += 0.25

        def on_membership_change(self, change):
            self.changes.append({{"epoch": self.epoch, "lost": len(change.lost), "joined": list(change.joined),
                                  "now": strategy.num_replicas_in_sync}})

    watch = Watch()
    history = model.fit(x, y, batch_size={BATCH}, epochs={K_EPOCHS}, shuffle=True, verbose=0, callbacks=[watch])
    json.dump({{"changes": watch.changes, "epochs": history.epoch, "loss": history.history["loss"],
               "world": strategy.num_replicas_in_sync, "iterations": int(model.optimizer.iterations),
               "weights": [w.tolist() for w in model.get_weights()]}}, open(f"kjoin_{{member}}.json", "w"))
"""

KERAS_JOIN_ONE_DEVICE = keras_one_device(K_STEPS, K_EPOCHS, "Adam(0.01)", shuffle=True)


def check_keras_rejoined(tmp_path: Path, script, members: list[int], joiner: int, *, lazy: bool = False) -> None:
    """The group shrank in epoch 1 and grew back at the start of an epoch when ``joiner`` joined, which
    then ran fit from that epoch; every member's weights equal, and equal to the one-device fit's
    (``lazy``: of a model built by fit)."""
    import numpy as np

    outs = {m: json.loads((tmp_path / f"kjoin_{m}.json").read_text()) for m in members}
    first = outs[joiner]["epochs"][0]  # the epoch the replacement's fit started at
    assert 1 < first < K_EPOCHS and outs[joiner]["epochs"] == list(range(first, K_EPOCHS)), outs[joiner]["epochs"]
    for m, out in outs.items():
        assert out["world"] == 3, (m, out["world"], out["changes"])
        assert out["iterations"] == K_EPOCHS * K_STEPS, (m, out["iterations"])
        if m != joiner:  # shrank in epoch 1, grew back at the start of epoch `first`
            assert out["changes"] == [
                {"epoch": 1, "lost": 1, "joined": [], "now": 2},
                {"epoch": first, "lost": 0, "joined": [f"replica:{joiner}"], "now": 3},
            ], out["changes"]
            assert out["epochs"] == list(range(K_EPOCHS))
            # The epochs' losses are the group's: the replacement's History has the same from its first.
            assert outs[joiner]["loss"] == out["loss"][first:], (m, out["loss"], outs[joiner]["loss"])
    assert outs[joiner]["changes"] == [{"epoch": None, "lost": 0, "joined": [f"replica:{joiner}"], "now": 3}]
    weights = [outs[m]["weights"] for m in members]
    assert all(np.array_equal(a, b) for other in weights[1:] for a, b in zip(weights[0], other))
    body = KERAS_JOIN_ONE_DEVICE.replace("keras.Input((8,)), ", "") if lazy else KERAS_JOIN_ONE_DEVICE
    reference = one_device(tmp_path, script, body, "keras_one_device.json")
    for a, b in zip(weights[0], reference):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_keras_fit_takes_a_replacement_back_at_an_epoch_boundary(tmp_path, script):
    res = elastic_run(
        tmp_path, script, "-n", "3", "--min-nproc", "2", env={"KERAS_BACKEND": "torch"}, timeout=200, body=KERAS_JOIN
    )
    assert res.returncode == 0, res.logs()
    assert "replica 3 started to replace it" in res.output, res.output
    assert not (tmp_path / "kjoin_2.json").exists()
    check_keras_rejoined(tmp_path, script, [0, 1, 3], joiner=3)


def test_tf_config_keras_fit_takes_back_a_replacement_started_by_hand(tmp_path, script):
    # The replacement started as a cluster manager would (see the custom loop's test above); the
    # model has no input shape: fit builds it, outside the scope, on the replacement too.
    job = script(KERAS_JOIN)
    workers = [f"127.0.0.1:{p}" for p in free_ports(3)]
    env = {"KERAS_BACKEND": "torch", "PHALANX_MIN_NPROC": "2", "PHALANX_COLLECTIVE_TIMEOUT": "60", "LAZY": "1"}
    tasks = [([sys.executable, str(job)], {**tf_config(workers, i), **env, "MEMBER": str(i)}) for i in range(3)]
    replacement = {**tf_config(workers, 2), **env, "PHALANX_JOIN_AS": "3", "WAIT_FOR": str(tmp_path / "lost")}
    results = run_jobs([*tasks, ([sys.executable, str(job)], replacement)], timeout=200, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0, -9, 0], [r.output[-3000:] for r in results]
    check_keras_rejoined(tmp_path, script, [0, 1, 3], joiner=3, lazy=True)


def test_keras_fit_refuses_a_replacement_with_another_model_by_name(tmp_path, script):
    res = elastic_run(
        tmp_path,
        script,
        "-n",
        "3",
        "--min-nproc",
        "2",
        env={"KERAS_BACKEND": "torch", "OTHER_MODEL": "1", "WAIT_S": "15"},
        timeout=200,
        body=KERAS_JOIN,
    )
    assert res.returncode == 0, res.logs()
    assert "replica 3 could not join: ElasticRecoveryError" in res.output, res.output
    refused = "replica:3 was refused: its model differs from the group's (variable 0: [[8, 32], 'float32'], the group's [[8, 16]"
    assert refused in res.output, res.output
    outs = [json.loads((tmp_path / f"kjoin_{m}.json").read_text()) for m in (0, 1)]
    assert [o["world"] for o in outs] == [2, 2]
    assert [len(o["changes"]) for o in outs] == [1, 1], outs[0]["changes"]  # the loss only


@pytest.mark.timeout(300)
def test_a_slurm_job_goes_on_when_srun_loses_a_task(slurm, tmp_path, script):  # noqa: F811
    """docs/deploy/slurm-elastic.sbatch on a real one-node Slurm cluster, 3 tasks: task 2 is
    SIGKILLed at step 30; the two others finish every step with every example once and the
    one-device weights. srun's exit status is the lost task's (the script's comment says so)."""
    shutil.copy(DEPLOY / "slurm-elastic.sbatch", tmp_path / "slurm-elastic.sbatch")
    # train.py: the custom loop above; its member number is the task's (SLURM_PROCID).
    script("import os\nos.environ['MEMBER'] = os.environ['SLURM_PROCID']\n" + textwrap.dedent(TRAIN), name="train.py")
    slurm.env.update({"KILL_MEMBER": "2", "PHALANX_COLLECTIVE_TIMEOUT": "60"})
    job = slurm.run(
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--cpus-per-task=1",
        "--overcommit",
        "slurm-elastic.sbatch",
        cwd=tmp_path,
    ).strip()
    fields = slurm.wait(job, timeout=180)
    output = (tmp_path / f"phalanx-elastic-{job}.out").read_text()
    assert "task 2: Killed" in output and fields["ExitCode"] == "137:0", f"{fields}\n{output}"
    check_survivors(tmp_path, script, [0, 1], lost=2, replicas=3)
