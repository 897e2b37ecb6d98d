"""OneDeviceStrategy: everything on one named device (``tf.distribute.OneDeviceStrategy``).

Example:
    >>> import torch, phalanx as px
    >>> strategy = px.OneDeviceStrategy("/cpu:0")
    >>> with strategy.scope():
    ...     layer = torch.nn.Linear(3, 2)
    >>> strategy.extended.worker_devices
    ('/job:localhost/replica:0/task:0/device:CPU:0',)
"""

from __future__ import annotations

from typing import Any

from phalanx.comm.communicator import LocalCommunicator
from phalanx.core.extended import StrategyExtended, tf_device_name
from phalanx.core.strategy import Strategy
from phalanx.devices import canonicalize
from phalanx.launch import mismatch


class OneDeviceExtended(StrategyExtended):
    """The machinery of :class:`OneDeviceStrategy`: one replica, no communication."""

    def __init__(self, device: Any) -> None:
        logical = canonicalize(device)
        name = (tf_device_name(logical),)
        mismatch.one_replica_strategy("OneDeviceStrategy")  # under `phalanx run -n 2`: two copies
        super().__init__(LocalCommunicator(), logical, name, name)


class OneDeviceStrategy(Strategy):
    """Places variables on ``device``, moves input there and runs there.

    Args:
        device: a TF name (``"/gpu:0"``, ``"/cpu:0"``, ``"/job:localhost/replica:0/task:0/device:GPU:0"``)
            or a torch name (``"cuda:0"``, ``"cpu"``).

    Raises:
        InvalidDeviceError: the device is malformed or absent.
    """

    def __init__(self, device: Any) -> None:
        super().__init__(OneDeviceExtended(device))
