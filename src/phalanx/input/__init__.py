"""Distributed input: splitting global batches, per-process pipelines, input contexts."""

from phalanx.input.context import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode, ValueContext
from phalanx.input.distributed_dataset import DatasetFromFunction, DistributedDataset, DistributedIterator

__all__ = ["AutoShardPolicy", "DatasetFromFunction", "DistributedDataset", "DistributedIterator", "InputContext",
           "InputOptions", "InputReplicationMode", "ValueContext"]
