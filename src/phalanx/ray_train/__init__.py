"""Ray Train: a phalanx program as the ``train_loop_per_worker`` of a ``TorchTrainer``.

Ray starts the workers, says who is who and restarts them after a failure; phalanx's strategies
find the job in Ray's context (:class:`~phalanx.cluster.RayTrainClusterResolver`) and join the
process group Ray made. This module is the rest of the bargain: what a worker reports to Ray
(metrics, and phalanx checkpoints that Ray persists to its storage), and where a restarted worker
resumes (the checkpoint Ray kept). The only module that imports Ray (with
:mod:`phalanx.ray_train.keras`, the Keras callback).

Example (``pip install -e ".[ray]"``)::

    import phalanx as px, phalanx.ray_train
    from phalanx.checkpoint import Checkpoint, Counter
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_loop_per_worker(config):
        strategy = px.MultiWorkerMirroredStrategy()        # Ray's workers are its replicas
        with strategy.scope():
            model, optimizer, step = make_model(), make_optimizer(), Counter()
        ckpt = Checkpoint(model=model, optimizer=optimizer, step=step)
        phalanx.ray_train.restore(ckpt)                    # after a restart: Ray's latest checkpoint
        for batch in strategy.experimental_distribute_dataset(batches[int(step):]):
            loss = strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None)
            step.assign_add(1)
            if int(step) % 100 == 0:
                phalanx.ray_train.report({"loss": float(loss), "step": int(step)}, checkpoint=ckpt)

    TorchTrainer(train_loop_per_worker, scaling_config=ScalingConfig(num_workers=4),
                 run_config=RunConfig(failure_config=FailureConfig(max_failures=3))).fit()
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from phalanx.checkpoint import Checkpoint, CheckpointManager
from phalanx.cluster.ray_train import ray_train_context
from phalanx.core.strategy import live_strategy
from phalanx.errors import ClusterSpecError

__all__ = ["in_ray_train", "report", "restore"]


def in_ray_train() -> bool:
    """Whether this process is a Ray Train worker (inside ``train_loop_per_worker``).

    Example:
        >>> in_ray_train()
        False
    """
    return ray_train_context() is not None


def _train() -> Any:
    """``ray.train``, in a Ray Train worker; a typed error anywhere else."""
    if not in_ray_train():
        raise ClusterSpecError(
            "ray.train.get_context()",
            None,
            "this process is not a Ray Train worker",
            hint="call phalanx.ray_train.report / restore inside the train_loop_per_worker of a "
            "ray.train.torch.TorchTrainer",
        )
    import ray.train

    return ray.train


def _scalar(value: Any) -> Any:
    """A metric as Ray stores it: a one-element tensor or array as a Python number."""
    if isinstance(value, torch.Tensor) or hasattr(value, "item"):
        return value.item()
    return value


def _shared_token() -> int:
    """A random number that every process of the job agrees on (the chief's, broadcast)."""
    token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    strategy = live_strategy()
    if strategy is not None and strategy.extended.num_processes > 1:
        strategy.extended.broadcast([token])
    return int(token[0])


def report(metrics: Mapping[str, Any], checkpoint: Checkpoint | CheckpointManager | None = None) -> str | None:
    """Reports ``metrics`` to Ray Train, with ``checkpoint`` saved for Ray to keep (collective).

    Every worker calls it at the same point, as every worker calls ``ray.train.report``. With a
    checkpoint, the chief writes it once (phalanx's format: every tensor, the manifest, its
    checksums) into a temporary directory, Ray persists that directory to its storage
    (``RunConfig(storage_path=...)``) with rank 0's metrics, and it is deleted here; Ray hands the
    latest one to a restarted worker group (:func:`restore`) and to ``Result.checkpoint``.

    Args:
        metrics: name -> value; one-element tensors become numbers. Ray keeps rank 0's.
        checkpoint: a :class:`~phalanx.checkpoint.Checkpoint`, or a
            :class:`~phalanx.checkpoint.CheckpointManager` (its checkpoint is saved), or None.

    Returns:
        The checkpoint's path in Ray's storage on the chief (None elsewhere, and without one).

    Raises:
        ClusterSpecError: this process is not a Ray Train worker.
    """
    train = _train()
    values = {str(k): _scalar(v) for k, v in metrics.items()}
    if checkpoint is None:
        train.report(values)
        return None
    ckpt = checkpoint.checkpoint if isinstance(checkpoint, CheckpointManager) else checkpoint
    # One path on every process, so that the chief alone writes it (Checkpoint.write's rule).
    path = os.path.join(tempfile.gettempdir(), f"phalanx-ray-{_shared_token():016x}")
    written = ckpt.write(path)
    if ray_train_context().get_world_rank() != 0:
        train.report(values)
        return None
    try:
        train.report(values, checkpoint=train.Checkpoint.from_directory(written))
    finally:
        shutil.rmtree(written, ignore_errors=True)  # Ray copied it to its storage (or failed, and raised)
    found = train.get_checkpoint()
    return found.path if found is not None else None


def restore(checkpoint: Checkpoint | CheckpointManager) -> str | None:
    """Restores the latest checkpoint Ray Train kept for this run into ``checkpoint``, if any.

    After a worker failed and Ray restarted the group (``FailureConfig(max_failures=...)``), or a
    run resumed, every worker reads the same checkpoint (no collective). A fresh run has none.

    Returns:
        Ray's path of the checkpoint restored, or None when Ray has none.

    Raises:
        ClusterSpecError: this process is not a Ray Train worker.
        CheckpointNotFoundError, CorruptCheckpointError, CheckpointMismatchError: as
            :meth:`~phalanx.checkpoint.Checkpoint.restore` (the directory is not a complete
            phalanx checkpoint, a file changed, a value does not fit).
    """
    train = _train()
    found = train.get_checkpoint()
    if found is None:
        return None
    ckpt = checkpoint.checkpoint if isinstance(checkpoint, CheckpointManager) else checkpoint
    with found.as_directory() as directory:
        ckpt.restore(directory)
    return found.path
