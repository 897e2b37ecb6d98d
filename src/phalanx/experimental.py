"""TF 2.0's ``tf.distribute.experimental`` names, for code written against them."""

from phalanx.input.context import InputOptions
from phalanx.strategies.central_storage import CentralStorageStrategy
from phalanx.strategies.multi_worker_mirrored import (
    CollectiveCommunication,
    CommunicationImplementation,
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
)
from phalanx.values import ReduceOp

__all__ = ["CentralStorageStrategy", "CollectiveCommunication", "CommunicationImplementation", "CommunicationOptions", "InputOptions",
           "MultiWorkerMirroredStrategy", "ReduceOp"]
