"""Distributed input: splitting global batches, per-process pipelines, input contexts."""

from phalanx.input.distributed_dataset import (
    DatasetFromFunction,
    DistributedDataset,
    DistributedIterator,
    SmallBatchWarning,
    UnbatchedElementError,
)
from phalanx.input.element_spec import EmptyOptionalError, Optional, TensorSpec
from phalanx.input.input_context import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode, ValueContext

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
