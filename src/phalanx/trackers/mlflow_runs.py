"""The MLflow tracker: one MLflow run per job, through MLflow's own client (``phalanx[mlflow]``).

The run goes where MLflow sends it: the ``tracking_uri`` given here, else MLflow's own setting
(``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``, else MLflow's default). Its experiment is
``experiment``, else ``MLFLOW_EXPERIMENT_NAME``, else MLflow's ``Default``. The config becomes the
run's parameters (nested keys joined with dots), the job's environment its tags
(``phalanx.strategy``, ``phalanx.num_replicas``, ``phalanx.version``, ``torch.version``); text
summaries become artifacts ``text/<name>/step_<step>.txt``. MLflow has no histograms: they are
skipped. Metrics are buffered and sent in batches at each flush (the end of every
``writer.as_default``), one request per step rather than one per value.

Example (a local file store; ``mlflow ui --backend-store-uri ./mlruns`` shows it)::

    from phalanx import summary
    from phalanx.trackers import MLflowTracker

    writer = summary.create_file_writer(
        "logs", trackers=("csv", MLflowTracker(tracking_uri="file:./mlruns", experiment="mnist")),
        config={"lr": 0.1})
"""

from __future__ import annotations

import time
from typing import Any

from phalanx.trackers.base import RunInfo, Tracker, flat

# MLflow's log_batch limits (mlflow.utils.validation): at most this many of each per request.
_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
_MAX_PARAM_LENGTH = 500  # the limit of MLflow 2.x (later versions allow more)


class MLflowTracker(Tracker):
    """Logs to an MLflow run.

    Args:
        tracking_uri: where the run goes (``file:./mlruns``, ``sqlite:///mlflow.db``,
            ``http://host:5000``); default: MLflow's own setting.
        experiment: the experiment's name (created if it does not exist); default:
            ``MLFLOW_EXPERIMENT_NAME``, else ``Default``.
    """

    name = "mlflow"
    module = "mlflow"
    extra = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None) -> None:
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self._client: Any = None
        self.run_id: str | None = None
        self._metrics: list[Any] = []

    def open(self, run: RunInfo) -> None:
        import os

        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        found = self._client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(name)
        created = self._client.create_run(experiment_id, run_name=run.run_name)
        self.run_id = created.info.run_id
        params = [Param(k, str(v)[:_MAX_PARAM_LENGTH]) for k, v in flat(run.config).items()]
        tags = [RunTag(k, str(v)) for k, v in run.environment.items()]
        for i in range(0, len(params), _MAX_PARAMS):
            self._client.log_batch(self.run_id, params=params[i : i + _MAX_PARAMS])
        for i in range(0, len(tags), _MAX_TAGS):
            self._client.log_batch(self.run_id, tags=tags[i : i + _MAX_TAGS])

    def scalar(self, name: str, value: float, step: int) -> None:
        from mlflow.entities import Metric

        self._metrics.append(Metric(name, float(value), int(time.time() * 1000), int(step)))

    def text(self, name: str, text: str, step: int) -> None:
        self._client.log_text(self.run_id, text, f"text/{name}/step_{step}.txt")

    def flush(self) -> None:
        metrics, self._metrics = self._metrics, []
        for i in range(0, len(metrics), _MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS])

    def close(self) -> None:
        if self.run_id is None or self._client is None:
            return
        try:
            self.flush()
        finally:
            self._client.set_terminated(self.run_id)
            self._client = None

    @property
    def location(self) -> str | None:
        if self.run_id is None:
            return None
        uri = self.tracking_uri
        if uri is None:
            import mlflow

            uri = mlflow.get_tracking_uri()
        return f"{uri} (run {self.run_id})"
