"""TensorBoard summaries (phalanx.summary, phalanx.keras.callbacks.TensorBoard): event files read back.

Under MirroredStrategy with 2 replica processes every replica reaches the summary calls, and the
job must leave exactly one set of event files, written by the chief, holding the reduced values.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx import summary  # noqa: E402

from conftest import PRELUDE, RUN_PROGRAMS, program_output, programs_job_env, run_job  # noqa: E402


def _events(logdir: Path) -> EventAccumulator:
    files = sorted(p for p in logdir.rglob("events.out.tfevents.*"))
    assert len(files) == 1, files  # exactly one writer wrote here
    acc = EventAccumulator(str(files[0]), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


# ------------------------------------------------------------------------------ in process
def test_scalar_and_histogram_in_one_process(tmp_path):
    import torch

    writer = summary.create_file_writer(tmp_path / "logs")
    with writer.as_default(step=3):
        assert summary.scalar("loss", torch.tensor(0.25)) is True
        assert summary.histogram("w", torch.arange(10.0)) is True
    summary.set_step(4)
    try:
        with writer.as_default():
            assert summary.scalar("loss", 0.125)
            with summary.record_if(False):
                assert summary.scalar("loss", 9.0, step=5) is False
    finally:
        summary.set_step(None)
    writer.close()
    acc = _events(tmp_path / "logs")
    assert _scalars(acc, "loss") == [(3, 0.25), (4, 0.125)]
    assert acc.Histograms("w")[0].histogram_value.num == 10


def test_summary_errors_are_typed(tmp_path):
    writer = summary.create_file_writer(tmp_path / "logs")
    assert summary.scalar("loss", 1.0, step=0) is False  # no default writer: nothing written
    with writer.as_default():
        with pytest.raises(summary.SummaryError, match="No step for summary 'loss'"):
            summary.scalar("loss", 1.0)
        with pytest.raises(summary.SummaryError, match="per-replica value") as e:
            summary.scalar("loss", px.PerReplica((1.0, 2.0)), step=0)
        assert "strategy.reduce" in e.value.hint
    assert summary.create_noop_writer().is_writing() is False


# ------------------------------------------------------------------------------ 2 replicas
# Both scripts below run in ONE job (scripts/run_programs.py), one after the other on the same two
# replica processes (the second strategy runs on the replicas the first one started): a process
# start costs more than either script's work. Each runs in its own folder, <job>/<index>.
CUSTOM_LOOP = """
import json, sys, torch
import phalanx as px
from phalanx import summary

logdir = sys.argv[1]
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
writer = summary.create_file_writer(logdir)         # every replica creates it; only the chief writes
torch.manual_seed(0)
with strategy.scope():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]

def step(x, y):
    loss = px.nn.compute_average_loss(((model(x) - y) ** 2).sum(1), global_batch_size=8)
    opt.zero_grad(); loss.backward(); opt.step()
    return loss

written, losses = [], []
for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
    loss = strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)
    losses.append(float(loss))
    with writer.as_default(step=i):
        written.append(summary.scalar("loss", loss))
        written.append(summary.histogram("weight", model.weight))
writer.close()
rank = strategy.extended.process_index
json.dump({"written": written, "losses": losses}, open(f"result_{rank}.json", "w"))
"""


def test_custom_loop_summaries_under_two_replicas_are_written_once(two_replica_job):
    tmp_path = _program(two_replica_job, 0, "the custom loop")
    chief, other = (json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(2))
    assert all(chief["written"]) and not any(other["written"])
    assert chief["losses"] == other["losses"]
    acc = _events(tmp_path / "tb")
    assert _scalars(acc, "loss") == [(i, pytest.approx(v)) for i, v in enumerate(chief["losses"])]
    assert [h.step for h in acc.Histograms("weight")] == [0, 1, 2]


KERAS_FIT = """
import json, os, sys
os.environ.setdefault("KERAS_BACKEND", "torch")
import keras, numpy as np
import phalanx as px
import phalanx.keras
from phalanx.keras.callbacks import TensorBoard

strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 8)).astype("float32")
y = (x.sum(1) > 0).astype("int64")
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
history = model.fit(x, y, epochs=2, batch_size=32, validation_split=0.25, verbose=0,
                    callbacks=[TensorBoard(sys.argv[1], histogram_freq=1, update_freq="batch")])
rank = strategy.extended.process_index
json.dump({k: [float(v) for v in vs] for k, vs in history.history.items()}, open(f"history_{rank}.json", "w"))
"""


@pytest.fixture(scope="module")
def two_replica_job(tmp_path_factory) -> tuple[Path, int, str]:
    """(job folder, exit code, output) of CUSTOM_LOOP then KERAS_FIT, each writing to <job>/<index>/tb."""
    out = tmp_path_factory.mktemp("tensorboard-two-replicas")
    programs = []
    for index, body in enumerate((CUSTOM_LOOP, KERAS_FIT)):
        (out / f"program_{index}.py").write_text(PRELUDE + body)
        programs.append([out / f"program_{index}.py", out / str(index) / "tb"])
    res = run_job([sys.executable, str(RUN_PROGRAMS)], timeout=120 + 180, cwd=out, env=programs_job_env(programs))
    return out, res.returncode, res.logs() if res.returncode != 0 else res.output


def _program(job: tuple[Path, int, str], index: int, name: str) -> Path:
    """Program ``index``'s folder, once its run finished (fails naming ``name`` otherwise)."""
    out, code, output = job
    program_output(code, output, index, 2, name)
    return out / str(index)


def test_keras_tensorboard_callback_under_two_replicas(two_replica_job):
    tmp_path = _program(two_replica_job, 1, "the Keras fit")
    history = json.loads((tmp_path / "history_0.json").read_text())
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["train", "validation"]
    train, validation = _events(tmp_path / "tb" / "train"), _events(tmp_path / "tb" / "validation")
    for name in ("loss", "accuracy"):
        assert _scalars(train, f"epoch_{name}") == [
            (e, pytest.approx(v, rel=1e-6)) for e, v in enumerate(history[name])
        ]
        assert _scalars(validation, f"epoch_{name}") == [
            (e, pytest.approx(v, rel=1e-6)) for e, v in enumerate(history[f"val_{name}"])
        ]
    assert _scalars(train, "epoch_learning_rate") == [(0, pytest.approx(0.05)), (1, pytest.approx(0.05))]
    assert [s for s, _ in _scalars(train, "batch_loss")] == list(range(1, 7))  # 96 rows / 32, 2 epochs
    kernels = [t for t in train.Tags()["histograms"] if t.endswith("kernel/histogram")]
    assert len(kernels) == 2 and all(len(train.Histograms(t)) == 2 for t in kernels)
