"""TF 2.0's ``tf.distribute.experimental`` names, for code written against them."""

import sys as _sys

from phalanx import coordinator
from phalanx.checkpoint.preemption import PreemptionCheckpointHandler, TerminationConfig
from phalanx.input.input_context import InputOptions, ValueContext
from phalanx.ps import partitioners
from phalanx.ps.parameter_server_strategy import ParameterServerStrategy
from phalanx.strategies.central_storage import CentralStorageStrategy
from phalanx.strategies.multi_worker_mirrored import (
    CollectiveCommunication,
    CommunicationImplementation,
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
)
from phalanx.strategies.tpu import TPUStrategy
from phalanx.values import ReduceOp

# `import phalanx.experimental.coordinator` / `.partitioners` work as in TF (aliases of the real modules).
_sys.modules[__name__ + ".coordinator"] = coordinator
_sys.modules[__name__ + ".partitioners"] = partitioners

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "InputOptions",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PreemptionCheckpointHandler",
    "ReduceOp",
    "TPUStrategy",
    "TerminationConfig",
    "ValueContext",
    "coordinator",
    "partitioners",
]
