"""Distributed input: splitting global batches, per-process pipelines, input contexts."""

from phalanx.input.context import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode, ValueContext
from phalanx.input.distributed_dataset import (
    DatasetFromFunction,
    DistributedDataset,
    DistributedIterator,
    SmallBatchWarning,
    UnbatchedElementError,
)
from phalanx.input.spec import EmptyOptionalError, Optional, TensorSpec

__all__ = [
    "AutoShardPolicy",
    "DatasetFromFunction",
    "DistributedDataset",
    "DistributedIterator",
    "EmptyOptionalError",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Optional",
    "SmallBatchWarning",
    "TensorSpec",
    "UnbatchedElementError",
    "ValueContext",
]
