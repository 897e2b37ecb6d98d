"""Building torch.distributed process groups as objects (not torch's global default group).

The groups are constructed directly, with the task's own address for gloo's listening sockets
(never 0.0.0.0) and phalanx's collective timeout, so that two communicators can live in one
process and nothing leaks between strategies. The options go through
:mod:`phalanx._compat.torch` (torch's private option fields).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from phalanx._compat.torch import gloo_options, nccl_options


def gloo_group(store: Any, rank: int, world_size: int, *, timeout: float, bind_addr: str) -> Any:
    """A gloo group of ``world_size`` ranks whose sockets listen on ``bind_addr``."""
    opts = gloo_options(datetime.timedelta(seconds=timeout), bind_addr)
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def nccl_group(store: Any, rank: int, world_size: int, *, timeout: float) -> Any:
    """An NCCL group (GPU replicas)."""
    return dist.ProcessGroupNCCL(store, rank, world_size, nccl_options(datetime.timedelta(seconds=timeout)))


def make_group(backend: str, store: Any, rank: int, world_size: int, *, timeout: float, bind_addr: str) -> Any:
    """The job's main group: ``"gloo"`` or ``"nccl"``."""
    if backend == "nccl":
        return nccl_group(store, rank, world_size, timeout=timeout)
    return gloo_group(store, rank, world_size, timeout=timeout, bind_addr=bind_addr)
