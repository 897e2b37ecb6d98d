"""Device names in TensorFlow form (``"/gpu:0"``, ``"/job:localhost/replica:0/task:0/device:GPU:0"``)
and torch form (``"cuda:0"``, ``"cpu"``), canonicalised to :class:`torch.device`.

A CPU index (``"cpu:1"``) names a *logical* CPU device: a replica process that computes on the CPU.
That is how several replicas are tested on a host without GPUs, as TF does with virtual CPUs.

Example:
    >>> from phalanx.devices import canonicalize
    >>> canonicalize("/job:localhost/replica:0/task:0/device:CPU:1")
    LogicalDevice(type='cpu', index=1)
    >>> canonicalize("cpu:1").torch_device  # every logical CPU device computes on torch's CPU
    device(type='cpu')

A GPU name is checked against the visible GPUs (needs two GPUs, so not run as a doctest)::

    >>> canonicalize("/gpu:1").torch_device  # doctest: +SKIP
    device(type='cuda', index=1)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.errors import DeviceNotFoundError, InvalidDeviceError

_HINT = "use a TF name ('/cpu:0', '/gpu:1', '/job:worker/task:0/device:GPU:0') or a torch name ('cpu', 'cuda:0')"
_TF_DEVICE = re.compile(r"(?:^|/)device:(?P<type>[A-Za-z]+):(?P<index>\d+)$")
_SHORT = re.compile(r"^/?(?P<type>[A-Za-z]+)(?::(?P<index>\d+))?$")
_TYPES = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "mps": "mps", "xpu": "xpu"}


@dataclass(frozen=True)
class LogicalDevice:
    """A replica's device. ``cpu:k`` is the k-th logical CPU replica; ``cuda:k`` is GPU k."""

    type: str
    index: int

    @property
    def torch_device(self) -> torch.device:
        # All logical CPU devices compute on the one torch CPU device, each in its own process.
        return torch.device("cpu") if self.type == "cpu" else torch.device(self.type, self.index)

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


def canonicalize(device: Any) -> LogicalDevice:
    """Parses a device given as a string or :class:`torch.device`.

    Raises:
        InvalidDeviceError: the name is malformed or names an unknown device type.
        DeviceNotFoundError: (an :class:`InvalidDeviceError`) the name is valid but this host does
            not have the GPU it names.
    """
    if isinstance(device, LogicalDevice):
        return device
    if isinstance(device, torch.device):
        dev_type, index = device.type, device.index or 0
    elif isinstance(device, str) and device.strip():
        text = device.strip()
        match = _TF_DEVICE.search(text) if "device:" in text.lower() else _SHORT.match(text)
        if match is None:
            raise InvalidDeviceError(device, hint=_HINT)
        dev_type = _TYPES.get(match.group("type").lower(), "")
        index = int(match.group("index") or 0)
        if not dev_type:
            raise InvalidDeviceError(device, hint=_HINT)
    else:
        raise InvalidDeviceError(device, hint=_HINT)
    if dev_type == "cuda" and index >= torch.cuda.device_count():
        raise DeviceNotFoundError(
            device, available=torch.cuda.device_count(), hint=_absent_gpu_hint(torch.cuda.device_count())
        )
    return LogicalDevice(dev_type, index)


def _absent_gpu_hint(gpus: int) -> str:
    """What to use instead of an absent GPU: the GPUs this host has, or the CPU when it has none."""
    if gpus:
        last = f"..'/gpu:{gpus - 1}'" if gpus > 1 else ""
        return (
            f"use '/gpu:0'{last} (torch: 'cuda:0'{last.replace('/gpu', 'cuda')}); CUDA_VISIBLE_DEVICES "
            "decides which GPUs this process sees"
        )
    return (
        "use the CPU: 'cpu', or CPU replicas 'cpu:0', 'cpu:1', ... for several replicas; for GPUs, install a "
        "CUDA build of torch and check CUDA_VISIBLE_DEVICES (torch.cuda.is_available() is False here)"
    )


def default_devices() -> list[LogicalDevice]:
    """Every visible GPU, or else the CPU as a single device (MirroredStrategy's default)."""
    n = torch.cuda.device_count()
    return [LogicalDevice("cuda", i) for i in range(n)] if n else [LogicalDevice("cpu", 0)]
