"""phalanx: tf.distribute's strategies for PyTorch and Keras 3 (torch backend).

Example:
    >>> import torch, phalanx as px
    >>> strategy = px.OneDeviceStrategy("cpu")
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(2, 1)
    >>> strategy.num_replicas_in_sync
    1
"""

from typing import TYPE_CHECKING

from phalanx._lazy import attach

# The facade is lazy (phalanx._lazy): a name is imported on first use, so `phalanx run`'s
# supervisor, which imports phalanx.launch only, does not import torch.
if TYPE_CHECKING:  # what type checkers and IDEs see: the names below, eagerly
    from phalanx import checkpoint, cluster_resolver, compiled, coordinator, experimental, interactive, nn
    from phalanx.cluster import ClusterSpec
    from phalanx.comm.cross_device_ops import (
        CrossDeviceOps,
        HierarchicalCopyAllReduce,
        NcclAllReduce,
        ReductionToOneDevice,
    )
    from phalanx.compiled import function
    from phalanx.context import (
        ReplicaContext,
        get_cross_replica_context,
        get_replica_context,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
    )
    from phalanx.distributed_variable import Variable, VariableAggregation, VariableSynchronization
    from phalanx.global_strategy import experimental_set_strategy
    from phalanx.input import (
        AutoShardPolicy,
        DistributedDataset,
        DistributedIterator,
        InputContext,
        InputOptions,
        InputReplicationMode,
        ValueContext,
    )
    from phalanx.options import RunOptions
    from phalanx.process import barrier, is_chief, num_processes, process_index
    from phalanx.ps.strategy import ParameterServerStrategy
    from phalanx.server import Server
    from phalanx.strategies.central_storage import CentralStorageStrategy
    from phalanx.strategies.fully_sharded import FullyShardedStrategy
    from phalanx.strategies.mirrored import MirroredStrategy
    from phalanx.strategies.multi_worker_mirrored import (
        CommunicationImplementation,
        CommunicationOptions,
        MultiWorkerMirroredStrategy,
    )
    from phalanx.strategies.one_device import OneDeviceStrategy
    from phalanx.strategies.tpu import TPUStrategy
    from phalanx.strategy import Strategy, StrategyExtended
    from phalanx.values import DistributedValues, Mirrored, PerReplica, ReduceOp

_SUBMODULES = frozenset(
    {"checkpoint", "cluster_resolver", "compiled", "coordinator", "experimental", "interactive", "nn"}
)
# name -> the module that defines it
_ATTRIBUTES = {
    "ClusterSpec": "phalanx.cluster",
    "CrossDeviceOps": "phalanx.comm.cross_device_ops",
    "HierarchicalCopyAllReduce": "phalanx.comm.cross_device_ops",
    "NcclAllReduce": "phalanx.comm.cross_device_ops",
    "ReductionToOneDevice": "phalanx.comm.cross_device_ops",
    "function": "phalanx.compiled",
    "Variable": "phalanx.distributed_variable",
    "VariableAggregation": "phalanx.distributed_variable",
    "VariableSynchronization": "phalanx.distributed_variable",
    "ReplicaContext": "phalanx.context",
    "get_cross_replica_context": "phalanx.context",
    "get_replica_context": "phalanx.context",
    "get_strategy": "phalanx.context",
    "has_strategy": "phalanx.context",
    "in_cross_replica_context": "phalanx.context",
    "experimental_set_strategy": "phalanx.global_strategy",
    "AutoShardPolicy": "phalanx.input",
    "DistributedDataset": "phalanx.input",
    "DistributedIterator": "phalanx.input",
    "InputContext": "phalanx.input",
    "InputOptions": "phalanx.input",
    "InputReplicationMode": "phalanx.input",
    "ValueContext": "phalanx.input",
    "RunOptions": "phalanx.options",
    "barrier": "phalanx.process",
    "is_chief": "phalanx.process",
    "num_processes": "phalanx.process",
    "process_index": "phalanx.process",
    "Server": "phalanx.server",
    "CentralStorageStrategy": "phalanx.strategies.central_storage",
    "FullyShardedStrategy": "phalanx.strategies.fully_sharded",
    "MirroredStrategy": "phalanx.strategies.mirrored",
    "CommunicationImplementation": "phalanx.strategies.multi_worker_mirrored",
    "CommunicationOptions": "phalanx.strategies.multi_worker_mirrored",
    "MultiWorkerMirroredStrategy": "phalanx.strategies.multi_worker_mirrored",
    "OneDeviceStrategy": "phalanx.strategies.one_device",
    "ParameterServerStrategy": "phalanx.ps.strategy",
    "TPUStrategy": "phalanx.strategies.tpu",
    "Strategy": "phalanx.strategy",
    "StrategyExtended": "phalanx.strategy",
    "DistributedValues": "phalanx.values",
    "Mirrored": "phalanx.values",
    "PerReplica": "phalanx.values",
    "ReduceOp": "phalanx.values",
}


__getattr__, __dir__, __all__ = attach(__name__, _SUBMODULES, _ATTRIBUTES)

__version__ = "0.1.0"
