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

from phalanx._lazy import alias_modules, attach

# The facade is lazy (phalanx._lazy): a name is imported on first use, so `phalanx run`'s
# supervisor, which imports phalanx.launch only, does not import torch.
if TYPE_CHECKING:  # what type checkers and IDEs see: the names below, eagerly
    from phalanx import checkpoint, cluster_resolver, coordinator, experimental, interactive, nn, trackers
    from phalanx.cluster import ClusterSpec
    from phalanx.comm.cross_device_ops import (
        CrossDeviceOps,
        HierarchicalCopyAllReduce,
        NcclAllReduce,
        ReductionToOneDevice,
    )
    from phalanx.comm.elastic import MembershipChange, on_membership_change
    from phalanx.core import compiled
    from phalanx.core.compiled import function
    from phalanx.core.context import (
        ReplicaContext,
        get_cross_replica_context,
        get_replica_context,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
    )
    from phalanx.core.distributed_variable import Variable, VariableAggregation, VariableSynchronization
    from phalanx.core.extended import StrategyExtended
    from phalanx.core.global_strategy import experimental_set_strategy
    from phalanx.core.options import RunOptions
    from phalanx.core.process import barrier, is_chief, num_processes, process_index, wait_for_chief
    from phalanx.core.strategy import Strategy
    from phalanx.input import (
        AutoShardPolicy,
        DistributedDataset,
        DistributedIterator,
        InputContext,
        InputOptions,
        InputReplicationMode,
        ValueContext,
    )
    from phalanx.profiler import profile
    from phalanx.progress_bar import progress
    from phalanx.ps.parameter_server_strategy import ParameterServerStrategy
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
    from phalanx.values import DistributedValues, Mirrored, PerReplica, ReduceOp

# public name -> the module it is
_SUBMODULES = {
    name: f"phalanx.{name}"
    for name in ("checkpoint", "cluster_resolver", "coordinator", "experimental", "interactive", "nn", "trackers")
} | {"compiled": "phalanx.core.compiled"}
# name -> the module that defines it
_ATTRIBUTES = {
    "ClusterSpec": "phalanx.cluster",
    "CrossDeviceOps": "phalanx.comm.cross_device_ops",
    "HierarchicalCopyAllReduce": "phalanx.comm.cross_device_ops",
    "NcclAllReduce": "phalanx.comm.cross_device_ops",
    "ReductionToOneDevice": "phalanx.comm.cross_device_ops",
    "MembershipChange": "phalanx.comm.elastic",
    "on_membership_change": "phalanx.comm.elastic",
    "function": "phalanx.core.compiled",
    "Variable": "phalanx.core.distributed_variable",
    "VariableAggregation": "phalanx.core.distributed_variable",
    "VariableSynchronization": "phalanx.core.distributed_variable",
    "ReplicaContext": "phalanx.core.context",
    "get_cross_replica_context": "phalanx.core.context",
    "get_replica_context": "phalanx.core.context",
    "get_strategy": "phalanx.core.context",
    "has_strategy": "phalanx.core.context",
    "in_cross_replica_context": "phalanx.core.context",
    "experimental_set_strategy": "phalanx.core.global_strategy",
    "AutoShardPolicy": "phalanx.input",
    "DistributedDataset": "phalanx.input",
    "DistributedIterator": "phalanx.input",
    "InputContext": "phalanx.input",
    "InputOptions": "phalanx.input",
    "InputReplicationMode": "phalanx.input",
    "ValueContext": "phalanx.input",
    "RunOptions": "phalanx.core.options",
    "barrier": "phalanx.core.process",
    "is_chief": "phalanx.core.process",
    "num_processes": "phalanx.core.process",
    "process_index": "phalanx.core.process",
    "wait_for_chief": "phalanx.core.process",
    "Server": "phalanx.server",
    "profile": "phalanx.profiler",
    "progress": "phalanx.progress_bar",
    "CentralStorageStrategy": "phalanx.strategies.central_storage",
    "FullyShardedStrategy": "phalanx.strategies.fully_sharded",
    "MirroredStrategy": "phalanx.strategies.mirrored",
    "CommunicationImplementation": "phalanx.strategies.multi_worker_mirrored",
    "CommunicationOptions": "phalanx.strategies.multi_worker_mirrored",
    "MultiWorkerMirroredStrategy": "phalanx.strategies.multi_worker_mirrored",
    "OneDeviceStrategy": "phalanx.strategies.one_device",
    "ParameterServerStrategy": "phalanx.ps.parameter_server_strategy",
    "TPUStrategy": "phalanx.strategies.tpu",
    "Strategy": "phalanx.core.strategy",
    "StrategyExtended": "phalanx.core.extended",
    "DistributedValues": "phalanx.values",
    "Mirrored": "phalanx.values",
    "PerReplica": "phalanx.values",
    "ReduceOp": "phalanx.values",
}


__getattr__, __dir__, __all__ = attach(__name__, _SUBMODULES, _ATTRIBUTES)

# `phalanx.compiled` is a public module path (`from phalanx.compiled import CompileFallbackWarning`);
# the module lives in phalanx.core.
alias_modules({"phalanx.compiled": "phalanx.core.compiled"})

__version__ = "0.1.0"
