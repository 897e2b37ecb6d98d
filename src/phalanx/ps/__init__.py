"""Parameter-server training: servers, workers, the coordinator, partitioners and sharded variables.

The user-facing pieces are :class:`phalanx.ParameterServerStrategy` and
:class:`phalanx.coordinator.ClusterCoordinator`; this package holds what they are built from:

=============================  ==========================================================================
``parameter_server_strategy``  ``ParameterServerStrategy``, its extended, serving a ps or worker task
``wire``                       signed frames: JSON header + raw tensors (+ blobs for shipped code), replay guard
``service``                    what every service does first: verify, refuse (rate-limited logs), lifetime
``tls``                        optional TLS settings; throwaway certificates for ``phalanx run --tls``
``transport``                  gRPC with generic handlers (no generated code); an in-process fake for tests
``client``                     calls to one task with timeouts, transient retries and typed errors
``variable_server``            the parameter server's fixed operations and its optimizers
``worker``                     running scheduled functions; pushing gradients from ``optimizer.step()``
``pickling``                   cloudpickle with per-worker objects (variables, datasets) by reference
``cluster_coordinator``        ``ClusterCoordinator``: dispatch to workers, heartbeats, fault handling
``closures``                   ``RemoteValue``, per-worker datasets, the queue of scheduled functions
``partitioners``               ``FixedShardsPartitioner``, ``MinSizePartitioner``, ``MaxSizePartitioner``
``remote_variables``           variable layout, ``ShardedVariable``, ``RemoteVariable``
``cluster_launcher``           ``phalanx run --ps M --workers N``: a local cluster
``testing``                    ``InProcessCluster``: every task in one process, for tests
=============================  ==========================================================================

Importing this package does not import gRPC or cloudpickle (the ``phalanx[ps]`` extra); they are
loaded when a cluster is started.
"""

from typing import TYPE_CHECKING

from phalanx._lazy import attach

# Lazy (phalanx._lazy): the cluster launcher (phalanx.ps.cluster_launcher) needs no torch.
if TYPE_CHECKING:
    from phalanx.ps.closures import PerWorkerDataset, PerWorkerIterator, RemoteValue
    from phalanx.ps.cluster_coordinator import ClusterCoordinator, WorkerState
    from phalanx.ps.errors import (
        AuthenticationError,
        CancelledError,
        ClusterSecretError,
        CoordinatorClosedError,
        ParameterServerUnavailableError,
        RemoteError,
        TaskUnavailableError,
        VariableError,
        WorkerUnavailableError,
    )
    from phalanx.ps.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner, Partitioner
    from phalanx.ps.remote_variables import RemoteVariable, ShardedVariable

_ATTRIBUTES = {
    "PerWorkerDataset": "phalanx.ps.closures",
    "PerWorkerIterator": "phalanx.ps.closures",
    "RemoteValue": "phalanx.ps.closures",
    "ClusterCoordinator": "phalanx.ps.cluster_coordinator",
    "WorkerState": "phalanx.ps.cluster_coordinator",
    "AuthenticationError": "phalanx.ps.errors",
    "CancelledError": "phalanx.ps.errors",
    "ClusterSecretError": "phalanx.ps.errors",
    "CoordinatorClosedError": "phalanx.ps.errors",
    "ParameterServerUnavailableError": "phalanx.ps.errors",
    "RemoteError": "phalanx.ps.errors",
    "TaskUnavailableError": "phalanx.ps.errors",
    "VariableError": "phalanx.ps.errors",
    "WorkerUnavailableError": "phalanx.ps.errors",
    "FixedShardsPartitioner": "phalanx.ps.partitioners",
    "MaxSizePartitioner": "phalanx.ps.partitioners",
    "MinSizePartitioner": "phalanx.ps.partitioners",
    "Partitioner": "phalanx.ps.partitioners",
    "RemoteVariable": "phalanx.ps.remote_variables",
    "ShardedVariable": "phalanx.ps.remote_variables",
}


def serve(cluster_resolver=None, **kwargs):  # noqa: ANN001, ANN003, ANN201 - ParameterServerStrategy's arguments
    """Serves this ``ps`` or ``worker`` task until the coordinator shuts the cluster down, then returns 0
    (3 when it exits orphaned: nothing authenticated from the chief for ``PHALANX_ORPHAN_TIMEOUT``).

    The explicit entry point of a server task (TF's ``tf.distribute.Server(...).join()``):
    ``ParameterServerStrategy(cluster_resolver, serve_and_exit=False, **kwargs).serve()``.

    Raises:
        ContextError: this task is the chief.
    """
    from phalanx.ps.parameter_server_strategy import ParameterServerStrategy

    return ParameterServerStrategy(cluster_resolver, serve_and_exit=False, **kwargs).serve()


__getattr__, __dir__, __all__ = attach(__name__, (), _ATTRIBUTES)
__all__ = [*__all__, "serve"]
