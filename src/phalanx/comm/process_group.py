"""Building torch.distributed process groups as objects (not torch's global default group).

The groups are constructed directly, with the task's own address for gloo's listening sockets
(never 0.0.0.0) and phalanx's collective timeout, so that two communicators can live in one
process and nothing leaks between strategies. The option fields used here (``_timeout``,
``_devices``) are torch's private API, kept to this module.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist


def gloo_group(store: Any, rank: int, world_size: int, *, timeout: float, bind_addr: str) -> Any:
    """A gloo group of ``world_size`` ranks whose sockets listen on ``bind_addr``."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_addr)]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def nccl_group(store: Any, rank: int, world_size: int, *, timeout: float) -> Any:
    """An NCCL group (GPU replicas)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def make_group(backend: str, store: Any, rank: int, world_size: int, *, timeout: float, bind_addr: str) -> Any:
    """The job's main group: ``"gloo"`` or ``"nccl"``."""
    if backend == "nccl":
        return nccl_group(store, rank, world_size, timeout=timeout)
    return gloo_group(store, rank, world_size, timeout=timeout, bind_addr=bind_addr)
