"""phalanx: tf.distribute's strategies for PyTorch and Keras 3 (torch backend).

Example:
    >>> import torch, phalanx as px
    >>> strategy = px.OneDeviceStrategy("cpu")
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(2, 1)
    >>> strategy.num_replicas_in_sync
    1
"""

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
from phalanx.server import Server
from phalanx.strategies.central_storage import CentralStorageStrategy
from phalanx.strategies.mirrored import MirroredStrategy
from phalanx.strategies.multi_worker_mirrored import (
    CommunicationImplementation,
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
)
from phalanx.strategies.one_device import OneDeviceStrategy
from phalanx.strategies.parameter_server import ParameterServerStrategy
from phalanx.strategies.tpu import TPUStrategy
from phalanx.strategy import Strategy, StrategyExtended
from phalanx.values import DistributedValues, Mirrored, PerReplica, ReduceOp

__version__ = "0.1.0"


__all__ = [
    "AutoShardPolicy",
    "CentralStorageStrategy",
    "ClusterSpec",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "TPUStrategy",
    "ValueContext",
    "barrier",
    "checkpoint",
    "cluster_resolver",
    "compiled",
    "coordinator",
    "experimental",
    "function",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "interactive",
    "is_chief",
    "nn",
    "num_processes",
    "process_index",
    "DistributedDataset",
    "DistributedIterator",
    "RunOptions",
    "Server",
    "experimental_set_strategy",
]
