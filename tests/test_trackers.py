"""Experiment trackers behind phalanx.summary, each read back with its own library's reader.

In one process (the chief of a one-process job): CSV (the standard library's reader), TensorBoard
(its EventAccumulator), MLflow (a file store, read with MlflowClient.get_metric_history) and W&B
(offline, its run file parsed with W&B's own record class). Bad input: an unknown tracker name, a
missing client, a step that goes back, a non-finite value, a tracker that fails mid-run. The
multi-process jobs (one run per tracker per job) are in tests/test_watch_job.py.
"""

from __future__ import annotations

import csv
import math
import sys
import warnings
from pathlib import Path

import pytest
import wandb_records

import phalanx as px
from phalanx import summary
from phalanx.errors import (
    NonFiniteSummaryWarning,
    SummaryError,
    TrackerFailedWarning,
    TrackerUnavailableError,
    UnknownTrackerError,
)
from phalanx.trackers import CSVTracker, MLflowTracker, Tracker

from conftest import client_or_skip


def _csv_rows(logdir: Path) -> list[tuple[int, str, float]]:
    with open(logdir / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "name", "value"]
    return [(int(s), n, float(v)) for s, n, v in rows[1:]]


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """An MLflow file store in tmp_path (MLflow 3.x needs MLFLOW_ALLOW_FILE_STORE for it)."""
    client_or_skip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


@pytest.fixture
def wandb_offline(monkeypatch):
    client_or_skip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    yield
    import wandb

    wandb.teardown()  # no W&B service left behind, whatever the test did


def _write_three_steps(writer) -> list[float]:
    import torch

    losses = [0.5, 0.25, 0.125]
    for step, loss in enumerate(losses):
        with writer.as_default(step=step):
            assert summary.scalar("loss", torch.tensor(loss)) is True
            summary.scalar("lr", 0.1)
            summary.histogram("weights", torch.arange(10.0) * (step + 1))
            summary.text("note", f"step {step}")
    return losses


# ------------------------------------------------------------------------------ each tracker
def test_csv_tracker_writes_step_name_value_and_the_run_description(tmp_path):
    writer = summary.create_file_writer(tmp_path / "run", trackers=("csv",), config={"lr": 0.1}, run_name="r")
    losses = _write_three_steps(writer)
    writer.close()
    rows = _csv_rows(tmp_path / "run")
    assert [(s, v) for s, n, v in rows if n == "loss"] == list(enumerate(losses))
    assert [n for s, n, v in rows if s == 0] == ["loss", "lr"]  # histograms and text have no place in a CSV
    import json

    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"] == {"lr": 0.1} and run["run_name"] == "r"
    assert run["environment"]["phalanx.num_replicas"] == "1"
    assert run["environment"]["torch.version"]


def test_tensorboard_tracker_is_read_back_by_tensorboard(tmp_path):
    client_or_skip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = summary.create_file_writer(tmp_path / "tb", trackers=("tensorboard",), config={"lr": 0.1})
    losses = _write_three_steps(writer)
    writer.close()
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == list(enumerate(losses))
    assert [h.step for h in acc.Histograms("weights")] == [0, 1, 2]
    assert {"config/text_summary", "phalanx/environment/text_summary", "note/text_summary"} <= set(
        acc.Tags()["tensors"]
    )


def test_mlflow_tracker_is_one_run_read_back_from_the_file_store(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    writer = summary.create_file_writer(
        tmp_path / "logs", trackers=("mlflow",), config={"lr": 0.1, "opt": {"name": "sgd"}}, run_name="baseline"
    )
    losses = _write_three_steps(writer)
    writer.close()
    client = MlflowClient(tracking_uri=mlflow_store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "Default"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "baseline" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == list(enumerate(losses))
    assert run.data.params == {"lr": "0.1", "opt.name": "sgd"}
    assert run.data.tags["phalanx.num_replicas"] == "1" and run.data.tags["phalanx.strategy"]
    texts = [a.path for a in client.list_artifacts(run.info.run_id, "text/note")]
    assert texts == [f"text/note/step_{s}.txt" for s in range(3)]


def test_mlflow_tracker_options_name_the_store_and_experiment(tmp_path, monkeypatch):
    client_or_skip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "elsewhere").as_uri()
    writer = summary.create_file_writer(tmp_path / "logs", trackers=(MLflowTracker(uri, experiment="mnist"),))
    with writer.as_default(step=7):
        summary.scalar("acc", 0.75)
    writer.close()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("mnist").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "acc")] == [(7, 0.75)]


def test_wandb_tracker_writes_one_offline_run_read_back_from_its_run_file(tmp_path, wandb_offline):
    writer = summary.create_file_writer(tmp_path / "logs", trackers=("wandb",), config={"lr": 0.1}, run_name="baseline")
    losses = _write_three_steps(writer)
    writer.close()
    (run_dir,) = (tmp_path / "logs" / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    rows = wandb_records.history(run_file)
    assert [(r["global_step"], r["loss"]) for r in rows] == list(enumerate(losses))
    assert [r["note"] for r in rows] == ["step 0", "step 1", "step 2"]
    assert all(r["weights/_type"] == "histogram" and sum(r["weights/values"]) == 10 for r in rows)
    config = wandb_records.config(run_file)
    assert config["lr"] == 0.1 and config["phalanx.num_replicas"] == "1"
    assert wandb_records.run_record(run_file).display_name == "baseline"


def test_wandb_keeps_a_metric_written_at_an_earlier_step_than_another(tmp_path, wandb_offline):
    # Keras-style: batch metrics at steps 1..4, then an epoch metric at step 0 (W&B's own step
    # would drop it; the global_step axis keeps it).
    writer = summary.create_file_writer(tmp_path / "logs", trackers=("wandb",))
    for step in range(1, 5):
        with writer.as_default(step=step):
            summary.scalar("batch_loss", 1.0 / step)
    with writer.as_default(step=0):
        summary.scalar("epoch_loss", 0.5)
    writer.close()
    (run_file,) = (tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    rows = wandb_records.history(run_file)
    assert [(r["global_step"], r["epoch_loss"]) for r in rows if "epoch_loss" in r] == [(0, 0.5)]
    assert len([r for r in rows if "batch_loss" in r]) == 4


def test_every_tracker_at_once_gets_the_same_values(tmp_path, mlflow_store, wandb_offline):
    from mlflow.tracking import MlflowClient

    writer = summary.create_file_writer(tmp_path / "logs", trackers=("tensorboard", "csv", "mlflow", "wandb"))
    losses = _write_three_steps(writer)
    writer.close()
    assert [(s, v) for s, n, v in _csv_rows(tmp_path / "logs") if n == "loss"] == list(enumerate(losses))
    client = MlflowClient(tracking_uri=mlflow_store)
    (run,) = client.search_runs(["0"])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == losses
    (run_file,) = (tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    assert [r["loss"] for r in wandb_records.history(run_file)] == losses
    assert len(list((tmp_path / "logs").glob("events.out.tfevents.*"))) == 1


# ------------------------------------------------------------------------------ bad input
def test_an_unknown_tracker_name_is_a_typed_error_naming_the_known_ones(tmp_path):
    with pytest.raises(UnknownTrackerError, match="Unknown tracker 'tensorbord'") as e:
        summary.create_file_writer(tmp_path, trackers=("csv", "tensorbord"))
    assert e.value.name == "tensorbord" and "'mlflow'" in e.value.hint
    assert isinstance(e.value, SummaryError)
    with pytest.raises(UnknownTrackerError):
        summary.create_file_writer(tmp_path, trackers=(42,))


@pytest.mark.parametrize("tracker, module", [("mlflow", "mlflow"), ("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_a_tracker_whose_client_is_missing_fails_at_create_file_writer_naming_the_extra(
    tmp_path, monkeypatch, tracker, module
):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it fails
    with pytest.raises(TrackerUnavailableError, match=f"needs the '{module}' package") as e:
        summary.create_file_writer(tmp_path, trackers=("csv", tracker))
    assert e.value.hint == f'pip install -e ".[{tracker}]"'
    assert not (tmp_path / "metrics.csv").exists()


def test_a_step_that_goes_back_is_refused_for_that_name(tmp_path):
    writer = summary.create_file_writer(tmp_path, trackers=("csv",))
    with writer.as_default(step=5):
        summary.scalar("loss", 1.0)
    with writer.as_default(step=5):
        summary.scalar("loss", 0.9)  # the same step again: allowed (TF allows it)
    with writer.as_default(step=2):
        summary.scalar("epoch_loss", 0.5)  # another name may be at an earlier step
        with pytest.raises(SummaryError, match="received step 2, before step 5") as e:
            summary.scalar("loss", 0.8)
    assert "global step" in e.value.hint
    writer.close()
    assert [(s, n) for s, n, v in _csv_rows(tmp_path)] == [(5, "loss"), (5, "loss"), (2, "epoch_loss")]


def test_a_per_replica_value_is_refused_with_a_hint(tmp_path):
    writer = summary.create_file_writer(tmp_path, trackers=("csv",))
    with writer.as_default(step=0), pytest.raises(SummaryError, match="per-replica value") as e:
        summary.scalar("loss", px.PerReplica((1.0, 2.0)))
    assert "strategy.reduce" in e.value.hint
    writer.close()


def test_a_non_finite_value_is_logged_with_one_warning(tmp_path):
    writer = summary.create_file_writer(tmp_path, trackers=("csv",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, value in enumerate([1.0, float("nan"), float("inf"), 2.0]):
            with writer.as_default(step=step):
                summary.scalar("loss", value)
    writer.close()
    found = [w for w in caught if issubclass(w.category, NonFiniteSummaryWarning)]
    assert len(found) == 1 and "'loss' is nan at step 1" in str(found[0].message)
    values = [v for s, n, v in _csv_rows(tmp_path)]
    assert values[0] == 1.0 and math.isnan(values[1]) and values[2] == math.inf and values[3] == 2.0


class _FailsAtStep(Tracker):
    """A fake tracker (in addition to the real ones) that raises from its third value on."""

    name = "flaky"

    def __init__(self) -> None:
        self.values: list[float] = []

    def scalar(self, name, value, step):
        if step >= 2:
            raise ConnectionError("the tracking server went away")
        self.values.append(value)


def test_a_tracker_failing_mid_run_warns_once_and_the_others_lose_nothing(tmp_path):
    flaky = _FailsAtStep()
    writer = summary.create_file_writer(tmp_path, trackers=(flaky, "csv"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            with writer.as_default(step=step):
                assert summary.scalar("loss", float(step)) is True
    writer.close()
    found = [w for w in caught if issubclass(w.category, TrackerFailedWarning)]
    assert len(found) == 1
    message = str(found[0].message)
    assert "'flaky' tracker failed in scalar() at step 2" in message and "ConnectionError" in message
    assert "'csv'" in message
    assert flaky.values == [0.0, 1.0]
    assert [v for s, n, v in _csv_rows(tmp_path)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [t.name for t in writer.trackers] == ["csv"]


def test_a_real_client_failing_mid_run_is_dropped_and_csv_keeps_every_value(tmp_path, mlflow_store):
    import shutil

    writer = summary.create_file_writer(tmp_path / "logs", trackers=("mlflow", "csv"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            with writer.as_default(step=step):
                summary.scalar("loss", float(step))
            if step == 1:
                shutil.rmtree(tmp_path / "mlruns")  # the tracking store is gone under the run
    writer.close()
    found = [w for w in caught if issubclass(w.category, TrackerFailedWarning)]
    assert len(found) == 1, [str(w.message) for w in found]
    assert "'mlflow' tracker failed in flush() at step 2" in str(found[0].message)
    assert [v for s, n, v in _csv_rows(tmp_path / "logs")] == [0.0, 1.0, 2.0, 3.0]


def test_a_tracker_that_cannot_start_its_run_is_a_typed_error(tmp_path):
    class _NoServer(CSVTracker):
        name = "noserver"

        def open(self, run):
            raise ConnectionRefusedError("no tracking server at http://127.0.0.1:1")

    writer = summary.create_file_writer(tmp_path, trackers=(_NoServer(),))
    with writer.as_default(step=0), pytest.raises(SummaryError, match="'noserver' tracker could not start its run"):
        summary.scalar("loss", 1.0)
    writer.close()


def test_config_must_be_a_dict(tmp_path):
    with pytest.raises(SummaryError, match="config must be a dict"):
        summary.create_file_writer(tmp_path, trackers=("csv",), config=[("lr", 0.1)])
