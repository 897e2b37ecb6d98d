"""A long run you can watch, end to end: real jobs, real tracker clients, read back with their own readers.

Two jobs, as the issue's "done when" says:

* a custom loop under ``MirroredStrategy(["cpu:0", "cpu:1"])`` (``python program.py``: the chief
  starts replica 1) with a writer to TensorBoard, CSV, MLflow (a file store) and W&B (offline), a
  ``phalanx.progress`` bar and a ``phalanx.profile`` of steps 2-3;
* Keras ``fit`` under ``MultiWorkerMirroredStrategy`` with 2 workers (``phalanx run -n 2``), with the
  ``Trackers`` callback to the same four trackers and ``TensorBoard(profile_batch=(2, 3))``.

Each must leave exactly one run per tracker holding the job-level values the program printed, one
progress bar (the chief's), one trace per replica that loads as JSON with the collectives marked,
and one job report, printed by the chief at exit.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from conftest import PRELUDE, client_or_skip, run_job  # noqa: E402

client_or_skip("tensorboard")
client_or_skip("mlflow")
client_or_skip("wandb")

import wandb_records  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

TRACKER_ENV = {
    "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3.x refuses the file store without it
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
}

CUSTOM_LOOP = """
import json, sys, torch
import phalanx as px
from phalanx import summary

logdir = sys.argv[1]
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
writer = summary.create_file_writer(logdir, trackers=("tensorboard", "csv", "mlflow", "wandb"),
                                    config={"lr": 0.1, "global_batch": 16}, run_name="custom-loop")
torch.manual_seed(0)
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(6)]

def step(x, y):
    loss = px.nn.compute_average_loss(((model(x) - y) ** 2).sum(1), global_batch_size=16)
    opt.zero_grad(); loss.backward(); opt.step()
    return loss

losses = []
with px.profile(logdir, steps=(2, 3)):
    bar = px.progress(strategy.experimental_distribute_dataset(data), desc="train", interval=0)
    for x, y in bar:
        loss = strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)
        losses.append(float(loss))
        bar.set_postfix(loss=loss)
        with writer.as_default(step=strategy.extended.step):
            summary.scalar("loss", loss)
writer.close()
report = summary.job_report(print_it=False)     # a collective: every replica calls it
print("LOSSES " + json.dumps(losses), flush=True)
print("REPORT " + json.dumps([[r.replica, r.steps, r.samples] for r in report.replicas]), flush=True)
"""


KERAS_FIT = """
import json, os, sys
os.environ.setdefault("KERAS_BACKEND", "torch")
import keras, numpy as np
import phalanx as px
from phalanx import summary
from phalanx.keras.callbacks import TensorBoard, Trackers

logdir = sys.argv[1]
strategy = px.MultiWorkerMirroredStrategy()
writer = summary.create_file_writer(logdir, trackers=("tensorboard", "csv", "mlflow", "wandb"),
                                    config={"optimizer": "sgd", "lr": 0.05}, run_name="keras-fit")
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 8)).astype("float32")
y = (x.sum(1) > 0).astype("int64")
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
history = model.fit(x, y, epochs=2, batch_size=32, validation_split=0.25, verbose=0,
                    callbacks=[Trackers(writer, update_freq="batch"),
                               TensorBoard(os.path.join(logdir, "tb"), profile_batch=(2, 3))])
if strategy.extended.process_index == 0:
    print("HISTORY " + json.dumps({k: [float(v) for v in vs] for k, vs in history.history.items()}), flush=True)
"""


def _printed(output: str, tag: str):
    lines = [line for line in output.splitlines() if line.startswith(tag + " ")]
    assert len(lines) == 1, output[-5000:]
    return json.loads(lines[0][len(tag) + 1 :])


def _csv_series(logdir: Path, name: str) -> list[tuple[int, float]]:
    with open(logdir / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))[1:]
    return [(int(s), float(v)) for s, n, v in rows if n == name]


def _tensorboard_series(logdir: Path, tag: str) -> list[tuple[int, float]]:
    (events,) = logdir.glob("events.out.tfevents.*")  # one event file: one writer
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _mlflow_run(uri: str, *metrics: str):
    """The job's one MLflow run and the history of ``metrics`` in it, read from the file store."""
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=uri)
        runs = client.search_runs(["0"])
        assert len(runs) == 1, [r.info.run_name for r in runs]  # one run for the job, not one per replica
        history = {m: [(h.step, h.value) for h in client.get_metric_history(runs[0].info.run_id, m)] for m in metrics}
    return runs[0], history


def _wandb_rows(logdir: Path) -> tuple[list[dict], dict]:
    runs = list((logdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # one W&B run for the job
    (run_file,) = runs[0].glob("run-*.wandb")
    return wandb_records.history(run_file), wandb_records.config(run_file)


def _traces(folder: Path, replicas: int) -> list[dict]:
    files = sorted(folder.glob("replica*.pt.trace.json"))
    assert [f.name for f in files] == [f"replica{r}.pt.trace.json" for r in range(replicas)]
    traces = [json.loads(f.read_text()) for f in files]
    for trace in traces:
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "phalanx::all_reduce" in names, sorted(n for n in names if n and "phalanx" in n)
    return traces


@pytest.fixture(scope="module")
def custom_loop_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("watch-custom-loop")
    (out / "program.py").write_text(PRELUDE + CUSTOM_LOOP)
    uri = (out / "mlruns").as_uri()
    res = run_job(
        [sys.executable, str(out / "program.py"), str(out / "run")],
        timeout=240,
        cwd=out,
        env={**TRACKER_ENV, "MLFLOW_TRACKING_URI": uri},
    )
    assert res.returncode == 0, res.logs()[-8000:]
    return out, uri, res


def test_custom_loop_leaves_one_run_per_tracker_with_the_printed_values(custom_loop_job):
    out, uri, res = custom_loop_job
    losses = _printed(res.output, "LOSSES")
    expected = [(step, pytest.approx(v, rel=1e-6)) for step, v in enumerate(losses, start=1)]
    run = out / "run"
    assert _csv_series(run, "loss") == expected
    assert _tensorboard_series(run, "loss") == expected
    mlflow_run, history = _mlflow_run(uri, "loss")
    assert history["loss"] == expected
    assert mlflow_run.info.run_name == "custom-loop"
    assert mlflow_run.data.params == {"lr": "0.1", "global_batch": "16"}
    assert mlflow_run.data.tags["phalanx.strategy"] == "MirroredStrategy"
    assert mlflow_run.data.tags["phalanx.num_replicas"] == "2"
    rows, config = _wandb_rows(run)
    assert [(r["global_step"], r["loss"]) for r in rows] == expected
    assert config["lr"] == 0.1 and config["phalanx.num_replicas"] == "2"
    assert json.loads((run / "run.json").read_text())["environment"]["phalanx.strategy"] == "MirroredStrategy"
    assert "TrackerFailedWarning" not in res.output and "tracker failed" not in res.output


def test_custom_loop_shows_one_progress_bar_on_the_chief(custom_loop_job):
    out, _, res = custom_loop_job
    lines = [line for line in res.output.splitlines() if line.startswith("train: step")]
    # No TTY: plain lines (interval=0: one per step), no carriage returns, the job's samples/s.
    assert [line.split(",")[0] for line in lines] == [f"train: step {n}/6 ({100 * n / 6:.0f}%)" for n in range(1, 7)]
    assert all("loss=" in line and "\r" not in line for line in lines)
    assert all("samples/s" in line for line in lines[1:])  # the job's speed, after the warm-up step
    assert "left" in lines[0]
    replica_logs = "".join(p.read_text() for p in res.log_dir.rglob("*.log"))
    assert "train: step" not in replica_logs  # replica 1 printed no bar


def test_custom_loop_profile_writes_one_trace_per_replica_with_collectives_marked(custom_loop_job):
    out, _, _ = custom_loop_job
    _traces(out / "run" / "plugins" / "profile" / "steps_2-3", replicas=2)


def test_custom_loop_job_report_is_printed_once_by_the_chief(custom_loop_job):
    out, _, res = custom_loop_job
    assert res.output.count("phalanx job report: MirroredStrategy, 2 replicas") == 1, res.output[-3000:]
    report = res.output[res.output.index("phalanx job report") :]
    assert "6 steps in" in report and "samples/s" in report and "waiting in collectives" in report
    lines = report.splitlines()
    replica_rows = [line.split() for line in lines[3:5]]
    assert [row[0] for row in replica_rows] == ["0", "1"] and all(row[1] == "6" for row in replica_rows)
    assert all(row[4] in ("MiB", "GiB") for row in replica_rows), report  # peak host memory
    assert any(float(row[2].rstrip("%")) > 0 for row in replica_rows), report  # the communicator's timers
    # phalanx.summary.job_report(), called by every replica, gathered every replica's row.
    assert _printed(res.output, "REPORT") == [[0, 6, 96], [1, 6, 96]]
    assert f"traces: {out / 'run' / 'plugins' / 'profile' / 'steps_2-3'}" in report
    assert f"logs: {out / 'run'}" in report


@pytest.fixture(scope="module")
def keras_fit_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("watch-keras-fit")
    (out / "program.py").write_text(PRELUDE + KERAS_FIT)
    uri = (out / "mlruns").as_uri()
    res = run_job(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(out / "program.py"), str(out / "run")],
        timeout=300,
        cwd=out,
        env={**TRACKER_ENV, "MLFLOW_TRACKING_URI": uri},
    )
    assert res.returncode == 0, res.logs()[-8000:]
    return out, uri, res


def test_keras_fit_under_multi_worker_leaves_one_run_per_tracker_with_fit_values(keras_fit_job):
    out, uri, res = keras_fit_job
    history = _printed(res.output, "HISTORY")
    run = out / "run"
    # 96 training rows / 32 per batch = 3 batches an epoch: epoch ends at global steps 3 and 6.
    for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
        expected = [(step, pytest.approx(v, rel=1e-6)) for step, v in zip((3, 6), history[name])]
        assert _csv_series(run, f"epoch_{name}") == expected, name
        assert _tensorboard_series(run, f"epoch_{name}") == expected, name
    assert [s for s, _ in _csv_series(run, "batch_loss")] == [1, 2, 3, 4, 5, 6]
    mlflow_run, logged = _mlflow_run(uri, "epoch_loss")
    assert logged["epoch_loss"] == [(step, pytest.approx(v, rel=1e-6)) for step, v in zip((3, 6), history["loss"])]
    assert mlflow_run.data.tags["phalanx.strategy"] == "MultiWorkerMirroredStrategy"
    assert mlflow_run.data.tags["phalanx.num_replicas"] == "2"
    assert mlflow_run.info.status == "FINISHED"
    assert "TrackerFailedWarning" not in res.output and "tracker failed" not in res.output
    rows, config = _wandb_rows(run)
    assert [r["epoch_val_loss"] for r in rows if "epoch_val_loss" in r] == [
        pytest.approx(v, rel=1e-6) for v in history["val_loss"]
    ]
    assert config["optimizer"] == "sgd"


def test_keras_tensorboard_profile_batch_writes_a_trace_per_worker(keras_fit_job):
    out, _, _ = keras_fit_job
    _traces(out / "run" / "tb" / "plugins" / "profile" / "batches_2-3", replicas=2)


def test_keras_fit_job_report_is_printed_once(keras_fit_job):
    _, _, res = keras_fit_job
    assert res.output.count("phalanx job report: MultiWorkerMirroredStrategy, 2 replicas") == 1, res.output[-3000:]


NEVER_CLOSED = """
import sys
from phalanx import summary

writer = summary.create_file_writer(sys.argv[1], trackers=("csv", "mlflow", "wandb"))
with writer.as_default(step=1):
    summary.scalar("loss", 0.5)
print("end of program", flush=True)
"""


def test_a_writer_never_closed_ends_its_runs_at_exit_without_a_warning(tmp_path):
    (tmp_path / "program.py").write_text(PRELUDE + NEVER_CLOSED)
    uri = (tmp_path / "mlruns").as_uri()
    res = run_job(
        [sys.executable, str(tmp_path / "program.py"), str(tmp_path / "run")],
        timeout=120,
        cwd=tmp_path,
        env={**TRACKER_ENV, "MLFLOW_TRACKING_URI": uri},
    )
    assert res.returncode == 0, res.logs()[-5000:]
    # W&B finishes its own run at exit; closing it again is not "a tracker failing mid-run".
    assert "TrackerFailedWarning" not in res.output, res.output
    run, history = _mlflow_run(uri, "loss")
    assert run.info.status == "FINISHED" and history["loss"] == [(1, 0.5)]
    rows, _ = _wandb_rows(tmp_path / "run")
    assert [r["loss"] for r in rows] == [0.5]


def test_a_job_that_only_logs_prints_its_report_at_exit(tmp_path):
    """No progress bar, no profile: a summary writer alone asks for the job report."""
    (tmp_path / "program.py").write_text(
        PRELUDE
        + """
import sys, torch
import phalanx as px
from phalanx import summary

strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
writer = summary.create_file_writer(sys.argv[1], trackers=("csv",))
for step in range(1, 4):
    loss = strategy.reduce("SUM", strategy.run(lambda: torch.ones(())), axis=None)
    with writer.as_default(step=step):
        summary.scalar("loss", loss)
writer.close()
"""
    )
    res = run_job([sys.executable, str(tmp_path / "program.py"), str(tmp_path / "run")], timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.logs()[-5000:]
    assert res.output.count("phalanx job report: MirroredStrategy, 2 replicas") == 1, res.output
    assert "3 steps in" in res.output and f"logs: {tmp_path / 'run' / 'metrics.csv'}" in res.output
