"""A Keras step's batch under a strategy: this replica's rows of the global batch Keras sliced.

:class:`_Step` cuts a global batch with the bounds ``experimental_distribute_dataset`` uses
(``torch.tensor_split``); a replica past the end of a short final batch gets a stand-in row of
weight 0, so that every replica takes part in every collective. A distributed dataset given to
``fit`` is handed to Keras as this replica's batches, each tagged with its global size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from phalanx import nest
from phalanx.input import global_batch
from phalanx.input.distributed_dataset import slice_bounds
from phalanx.values import local_results

if TYPE_CHECKING:
    pass


def _batch_size(batch: Any) -> int:
    for leaf in nest.flatten(batch):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
    raise ValueError(f"A Keras batch must contain an array with a batch dimension; received {batch!r:.200}")


def _rows(batch: Any, start: int, end: int) -> Any:
    def cut(leaf: Any) -> Any:
        shape = getattr(leaf, "shape", None)
        return leaf[start:end] if shape is not None and len(shape) > 0 else leaf

    return nest.map_structure(cut, batch)


def _is_float(variable: Any) -> bool:
    return "float" in str(variable.dtype)


class _Step:
    """This replica's part of one global batch."""

    def __init__(self, batch: Any, num_replicas: int, rank: int) -> None:
        # The global batch and how it was cut: an elastic job whose group re-formed during the
        # step cuts it again for the step's new attempt.
        self.batch, self.split = batch, (num_replicas, rank)
        self.global_size = _batch_size(batch)
        start, end = slice_bounds(self.global_size, num_replicas, rank)
        self.empty = end <= start
        # A replica past the end of a short final batch computes on a stand-in row, weight 0.
        self.local = _rows(batch, 0, 1) if self.empty else _rows(batch, start, end)
        self.share = 0.0 if self.empty else (end - start) / self.global_size

    @classmethod
    def local(cls, batch: Any, global_size: int) -> "_Step":
        """A step on a batch that is already this replica's part of a global batch of ``global_size``."""
        step = cls.__new__(cls)
        step.batch, step.split = None, None
        step.global_size = global_size
        rows = _batch_size(batch)
        step.empty = rows == 0
        step.local = _stand_in(batch) if step.empty else batch
        step.share = 0.0 if step.empty else rows / global_size
        return step


def _stand_in(batch: Any) -> Any:
    """One row of zeros shaped as ``batch``'s rows: the stand-in of a replica whose part is empty."""

    def row(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.new_zeros((1, *leaf.shape[1:]))
        if isinstance(leaf, np.ndarray) and leaf.ndim > 0:
            return np.zeros((1, *leaf.shape[1:]), leaf.dtype)
        return leaf

    return nest.map_structure(row, batch)


def _is_distributed_input(value: Any) -> bool:
    from phalanx.input.distributed_dataset import DatasetFromFunction, DistributedDataset

    return isinstance(value, (DistributedDataset, DatasetFromFunction))


class _LocalBatches(torch.utils.data.IterableDataset):
    """A distributed dataset's batches for this replica, each tagged with its global batch's size.

    Each ``iter()`` starts a pass of the distributed dataset (a collective: every replica starts
    it). Keras keeps its iterator across epochs when given the number of steps and starts a new
    one after as many batches as the dataset has, which is TF's Keras's way with a distributed
    dataset: ``fit`` goes on from where the last epoch stopped.
    """

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        self._dataset = dataset

    def __iter__(self) -> Any:
        for batch in self._dataset:
            info = global_batch.find((batch,), {})
            local = nest.map_structure(lambda v: local_results(v)[0], batch)
            if info is not None:
                global_batch.tag(local, info)
            yield local


class _SizedLocalBatches(_LocalBatches):
    """A :class:`_LocalBatches` of a dataset of known length (a DistributedDataset of a sized loader)."""

    def __len__(self) -> int:
        return len(self._dataset)


class _LocalLoader(torch.utils.data.DataLoader):
    """A :class:`_LocalBatches` as Keras takes it: a DataLoader of ready batches."""

    def __init__(self, batches: "_LocalBatches") -> None:
        super().__init__(batches, batch_size=None)
