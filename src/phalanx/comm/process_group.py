"""Building torch.distributed process groups as objects (not torch's global default group).

The groups are constructed directly, with the task's own address for gloo's listening sockets
(never 0.0.0.0) and phalanx's collective timeout, so that two communicators can live in one
process and nothing leaks between strategies. The options go through
:mod:`phalanx._compat.torch` (torch's private option fields).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import struct
import sys
from typing import Any, Iterator

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


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (Linux), else None."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX host
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                # SIOCGIFADDR: the interface's IPv4 address.
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


@contextlib.contextmanager
def _gloo_interface(bind_addr: str) -> Iterator[None]:
    # torch's default group builds its gloo device from GLOO_SOCKET_IFNAME (else from the host
    # name): named after the interface of the task's own address, gloo listens there only.
    name = os.environ.get("GLOO_SOCKET_IFNAME") or interface_of(bind_addr)
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved


def init_default_group(
    backend: str, store: Any, rank: int, world_size: int, *, timeout: datetime.timedelta, bind_addr: str
) -> None:
    """Makes torch's default process group (what DeviceMesh, FSDP2 and DTensor run on) from ``store``.

    ``backend``: ``"gloo"``, or ``"cpu:gloo,cuda:nccl"`` for GPU replicas. gloo's sockets listen
    on ``bind_addr``'s interface, not on the address the host name resolves to.
    """
    # init_process_group wraps sys.excepthook to prefix "[rankK]: " to every traceback line, once
    # more per group: phalanx's replicas already name themselves in their reports.
    hook = sys.excepthook
    try:
        with _gloo_interface(bind_addr):
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    finally:
        sys.excepthook = hook
