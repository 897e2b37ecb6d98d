"""Test-only: phalanx programs as Ray Train's ``train_loop_per_worker``, on a real local Ray cluster.

``python ray_train_job.py OUT_DIR CASE [CASE ...]`` starts Ray on this machine (2 CPUs), runs each
case as a ``TorchTrainer`` with 2 CPU workers, computes the one-device run it must equal in this
process, and writes ``OUT_DIR/<case>.json`` for tests/test_ray_train.py to check. Cases:

* ``multi_worker`` / ``mirrored``: a torch loop under ``MultiWorkerMirroredStrategy()`` /
  ``MirroredStrategy()``, reporting metrics and a checkpoint through ``phalanx.ray_train.report``
  every 5 steps; the last reported checkpoint's weights against the one-device run's.
* ``failure``: the same loop; on the first attempt worker 1 kills itself (SIGKILL) after step 12;
  ``FailureConfig(max_failures=1)`` restarts the workers, which resume from the latest checkpoint
  Ray registered (``phalanx.ray_train.restore``: step 10, or step 5 where Ray's controller had not
  yet taken in the step-10 report when the worker died) and end where the uninterrupted run ends.
* ``keras``: Keras ``fit`` with ``phalanx.ray_train.keras.ReportCheckpointCallback``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

STEPS, BATCH, FEATURES = 20, 16, 8


def batches():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH, FEATURES, generator=g)
    y = x @ torch.linspace(-1, 1, FEATURES).unsqueeze(1) + 0.1 * torch.randn(len(x), 1, generator=g)
    return list(zip(x.split(BATCH), y.split(BATCH)))


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Dropout(0.0), torch.nn.Linear(16, 1)
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def one_device() -> dict[str, list]:
    """The run every distributed case must equal: one device, the global batches, the same start."""
    model, optimizer = make_model()
    for x, y in batches():
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def torch_loop(config):
    """``train_loop_per_worker``: a plain phalanx program, plus Ray's report and restore."""
    import signal

    import phalanx as px
    import phalanx.ray_train
    from phalanx.checkpoint import Checkpoint, Counter

    if config.get("min_nproc"):  # an elastic job's bound: Ray restarts the group itself, so refused
        os.environ["PHALANX_MIN_NPROC"] = str(config["min_nproc"])
    strategy = px.MultiWorkerMirroredStrategy() if config["strategy"] == "multi_worker" else px.MirroredStrategy()
    with strategy.scope():
        model, optimizer = make_model()
        step = Counter()
    ckpt = Checkpoint(model=model, optimizer=optimizer, step=step)
    resumed = phalanx.ray_train.restore(ckpt)
    start = int(step)
    if resumed is not None:
        print(f"worker {px.process_index()}: resumed at step {start} from {resumed}", flush=True)
    data = batches()
    for x, y in strategy.experimental_distribute_dataset(data[start:]):

        def train_step(xb, yb):
            per_example = ((model(xb) - yb) ** 2).mean(dim=1)
            loss = px.nn.compute_average_loss(per_example, global_batch_size=BATCH)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss

        loss = strategy.reduce("SUM", strategy.run(train_step, args=(x, y)), axis=None)
        step.assign_add(1)
        if int(step) % 5 == 0:
            metrics = {
                "loss": float(loss),
                "step": int(step),
                "replicas": strategy.num_replicas_in_sync,
                "resumed_at": start,
                "strategy": type(strategy).__name__,
            }
            phalanx.ray_train.report(metrics, checkpoint=ckpt)
        marker = config.get("kill_marker")
        if marker and int(step) == 12 and px.process_index() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # a worker lost mid-run: Ray restarts the group


def keras_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def keras_data():
    x = torch.cat([b[0] for b in batches()]).numpy()
    y = torch.cat([b[1] for b in batches()]).numpy()
    return x, y


def keras_loop(config):
    import phalanx as px
    from phalanx.ray_train.keras import ReportCheckpointCallback

    strategy = px.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras_model()
    x, y = keras_data()
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[ReportCheckpointCallback()])


def keras_one_device() -> list[list]:
    model = keras_model()
    x, y = keras_data()
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    return [w.tolist() for w in model.get_weights()]


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    import ray

    env = {
        "KERAS_BACKEND": "torch",
        "PHALANX_COLLECTIVE_TIMEOUT": "60",
        "PHALANX_RENDEZVOUS_TIMEOUT": "60",
        "OMP_NUM_THREADS": "1",
    }
    started = time.monotonic()
    # Ray's sockets live under its temp dir, and a Unix socket path has at most 107 bytes: pytest's
    # tmp_path is too deep, so a short directory of our own, removed at the end.
    temp = tempfile.mkdtemp(prefix="pxray-")
    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",  # loopback: the test's cluster is this machine only
        include_dashboard=False,
        _temp_dir=temp,
        runtime_env={"env_vars": env},
        logging_level="WARNING",
    )
    print(f"ray up in {time.monotonic() - started:.1f} s", flush=True)
    try:
        run_cases(out, cases)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def run_cases(out: str, cases: list[str]) -> None:
    """Runs each case as a TorchTrainer on the Ray cluster this process started."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    for case in cases:
        began = time.monotonic()
        record: dict = {"case": case}
        try:
            if case == "keras":
                loop, config = keras_loop, {}
            else:
                loop = torch_loop
                config = {"strategy": "mirrored" if case == "mirrored" else "multi_worker"}
            failures = 0
            if case == "failure":
                config["kill_marker"] = os.path.join(out, "killed-once")
                failures = 1
            if case == "min_nproc":
                config["min_nproc"] = 1
            trainer = TorchTrainer(
                loop,
                train_loop_config=config,
                scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                run_config=RunConfig(
                    name=case,
                    storage_path=os.path.join(out, "storage"),
                    failure_config=FailureConfig(max_failures=failures),
                ),
            )
            result = trainer.fit()
            record["metrics"] = result.metrics
            record["checkpoint"] = result.checkpoint.path if result.checkpoint is not None else None
            record["killed"] = os.path.exists(os.path.join(out, "killed-once"))
            if record["checkpoint"] is not None:
                from phalanx.checkpoint import load_state

                if case == "keras":
                    record["weights"] = _keras_weights(record["checkpoint"])
                else:
                    state = load_state(record["checkpoint"])
                    record["state_keys"] = sorted(state)
                    record["weights"] = {k: v.tolist() for k, v in state["model"].items()}
            record["expected"] = keras_one_device() if case == "keras" else one_device()
        except BaseException as e:  # noqa: BLE001 - each case reports its own failure
            record["error"] = f"{type(e).__name__}: {e}"
            record["traceback"] = traceback.format_exc()
        record["seconds"] = round(time.monotonic() - began, 1)
        print(f"case {case}: {record.get('error', 'done')} in {record['seconds']} s", flush=True)
        with open(os.path.join(out, f"{case}.json"), "w") as f:
            json.dump(record, f, default=str)


def _keras_weights(path: str) -> list[list]:
    """The weights of the Keras model in the checkpoint at ``path``, in ``get_weights()`` order."""
    from phalanx.checkpoint import Checkpoint

    model = keras_model()
    Checkpoint(model=model).read(path).expect_partial()
    return [w.tolist() for w in model.get_weights()]


if __name__ == "__main__":
    main()
