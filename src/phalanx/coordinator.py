"""``phalanx.coordinator``: TF's ``tf.distribute.experimental.coordinator`` (also ``phalanx.experimental.coordinator``).

Example:
    >>> from phalanx.coordinator import ClusterCoordinator, RemoteValue
    >>> ClusterCoordinator.__name__
    'ClusterCoordinator'
"""

import abc

from phalanx.ps.closures import PerWorkerDataset, PerWorkerIterator, RemoteValue
from phalanx.ps.cluster_coordinator import ClusterCoordinator, WorkerState
from phalanx.ps.errors import CancelledError, ParameterServerUnavailableError


class PerWorkerValues(abc.ABC):  # noqa: B024 - a marker base, as TF's is to its users
    """A value with one component per worker (TF's ``PerWorkerValues`` / ``PerWorkerValue``).

    ``create_per_worker_dataset`` and ``iter()`` of it give such values: passed to a scheduled
    function, each resolves to the component of the worker that runs it. Use ``isinstance`` to
    recognise them; they are not built by hand.
    """


PerWorkerValues.register(PerWorkerDataset)
PerWorkerValues.register(PerWorkerIterator)
PerWorkerValue = PerWorkerValues


def experimental_get_current_worker_index() -> int:
    """Inside a scheduled function: the index of the worker running it.

    Raises:
        RuntimeError: called outside a function scheduled with ClusterCoordinator.
    """
    from phalanx.ps.worker import active_run

    run = active_run()
    if run is None:
        raise RuntimeError(
            "experimental_get_current_worker_index() must be called inside a function given to "
            "ClusterCoordinator.schedule"
        )
    return int(run.service.index)


__all__ = [
    "CancelledError",
    "ClusterCoordinator",
    "ParameterServerUnavailableError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValue",
    "PerWorkerValues",
    "RemoteValue",
    "WorkerState",
    "experimental_get_current_worker_index",
]
