"""The default strategy: what is current when no strategy's scope is open (one replica, no-op)."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from phalanx import context
from phalanx.comm.communicator import LocalCommunicator
from phalanx.devices import LogicalDevice
from phalanx.strategy import Strategy, StrategyExtended, _tf_name


class DefaultStrategy(Strategy):
    """One replica on the current device; ``scope()`` does not capture variables (as in TF)."""

    _is_default = True

    def __init__(self) -> None:
        device = LogicalDevice("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else LogicalDevice("cpu", 0)
        name = (_tf_name(device),)
        super().__init__(StrategyExtended(LocalCommunicator(), device, name, name))

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        with context.enter_scope(self):
            yield self


@functools.lru_cache(maxsize=1)
def default_strategy() -> DefaultStrategy:
    # Stateless apart from its device, so one per process is enough (TF has one too).
    return DefaultStrategy()
