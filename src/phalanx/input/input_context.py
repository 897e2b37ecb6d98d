"""Input contexts and options (``tf.distribute.InputContext``, ``InputOptions``, ...).

Example:
    >>> from phalanx.input import InputContext
    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    >>> ctx.get_per_replica_batch_size(64)
    16
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AutoShardPolicy(enum.Enum):
    """How a dataset is divided among workers (``tf.data.experimental.AutoShardPolicy``).

    ``AUTO``: ``FILE`` when the dataset can be sharded by files (it has a ``shard(num, index)``
    method), else ``DATA``. ``DATA``: every process reads the same global batches and keeps its
    slice of each. ``FILE``: each worker reads only its own part (``dataset.shard(num, index)``)
    and its batches are split among its local replicas. ``OFF``: no sharding across workers; each
    worker splits its own batches among its local replicas.
    """

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"


class InputReplicationMode(enum.Enum):
    """How many input pipelines ``distribute_datasets_from_function`` builds (``tf.distribute.InputReplicationMode``).

    ``PER_WORKER`` (the default, TF's): ``dataset_fn`` is called once per worker
    (``num_input_pipelines`` = workers, ``input_pipeline_id`` = the worker's index) and the
    worker's replicas take its elements in turn: replica ``k`` of ``N`` gets elements ``k``,
    ``k + N``, ... Each replica being a process here, every process of a worker reads the worker's
    whole pipeline (the same stream, see :mod:`phalanx.input.distributed_dataset`) and keeps its
    elements. ``PER_REPLICA``: ``dataset_fn`` is called once per replica (``num_input_pipelines`` =
    replicas, ``input_pipeline_id`` = the replica's id) and each replica reads only its own
    pipeline: faster where a worker has several replicas (no element is read twice), and
    ``dataset_fn`` must shard by the replica.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclass(frozen=True)
class InputOptions:
    """Options of distributed datasets (``tf.distribute.InputOptions``).

    Attributes:
        experimental_fetch_to_device: move each batch to the replica's device (default True).
        experimental_per_replica_buffer_size: batches prefetched to the device ahead of use.
        auto_shard_policy: how the dataset is divided among workers.
        experimental_replication_mode: one ``distribute_datasets_from_function`` pipeline per
            worker (``PER_WORKER``, TF's default) or per replica (``PER_REPLICA``); see
            :class:`InputReplicationMode`.
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1
    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False


@dataclass(frozen=True, repr=False)
class InputContext:
    """What an input pipeline needs to know to produce its part of the data.

    Attributes:
        num_input_pipelines: how many pipelines the job runs (one per worker; one per replica
            with ``InputReplicationMode.PER_REPLICA``).
        input_pipeline_id: this pipeline's index, ``0 <= id < num_input_pipelines``.
        num_replicas_in_sync: replicas of the whole job.
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica should get; the global batch must divide evenly."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"The global batch size ({global_batch_size}) must be divisible by "
                f"num_replicas_in_sync ({self.num_replicas_in_sync})."
            )
        return global_batch_size // self.num_replicas_in_sync

    def __str__(self) -> str:
        # TF's text, "tf.distribute." renamed.
        return f"phalanx.InputContext(input pipeline id {self.input_pipeline_id}, total: {self.num_input_pipelines})"

    __repr__ = __str__


@dataclass(frozen=True, repr=False)
class ValueContext:
    """Passed to ``experimental_distribute_values_from_function``'s function."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1

    def __str__(self) -> str:
        # TF's text (its double space included), "tf.distribute." renamed.
        return (
            f"phalanx.ValueContext(replica id {self.replica_id_in_sync_group},  "
            f"total replicas in sync: {self.num_replicas_in_sync})"
        )

    __repr__ = __str__
