"""``phalanx.coordinator``: TF's ``tf.distribute.experimental.coordinator`` (also ``phalanx.experimental.coordinator``).

Example:
    >>> from phalanx.coordinator import ClusterCoordinator, RemoteValue
    >>> ClusterCoordinator.__name__
    'ClusterCoordinator'
"""

from phalanx.ps.closures import PerWorkerDataset, PerWorkerIterator, RemoteValue
from phalanx.ps.coordinator import ClusterCoordinator, WorkerState
from phalanx.ps.errors import CancelledError, ParameterServerUnavailableError

__all__ = ["CancelledError", "ClusterCoordinator", "ParameterServerUnavailableError", "PerWorkerDataset",
           "PerWorkerIterator", "RemoteValue", "WorkerState"]
