"""MirroredStrategy: synchronous training with one replica per local device.

Every replica is a process (see DESIGN.md). ``python train.py`` starts the other N-1 replica
processes itself; ``phalanx run -n N train.py`` starts all N explicitly. Parameters created in
``scope()`` are broadcast from replica 0, so they start identical; their gradients are summed
across replicas during backward, so every replica applies the same update and they stay
bit-identical.

Example (``train.py``; two CPU replicas on a host without GPUs)::

    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(10, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x, y))
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from phalanx.comm.cross_device_ops import CrossDeviceOps
from phalanx.devices import LogicalDevice, canonicalize, default_devices
from phalanx.errors import ClusterSpecError, InvalidDeviceError
from phalanx.launch.env import ReplicaEnv
from phalanx.strategies.common import build_communicator, close_at_exit, configure_cpu_threads
from phalanx.strategy import Strategy, StrategyExtended, _tf_name


def _local_devices(devices: Sequence[Any] | None, env: ReplicaEnv | None) -> list[LogicalDevice]:
    if devices is None:
        if env is None:
            return default_devices()
        gpus = torch.cuda.device_count()
        kind = "cuda" if gpus >= env.local_world_size else "cpu"
        return [LogicalDevice(kind, i) for i in range(env.local_world_size)]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    parsed = [canonicalize(d) for d in devices]
    if not parsed:
        raise InvalidDeviceError(devices, hint="give at least one device, e.g. ['cpu:0', 'cpu:1']")
    if len(set(parsed)) != len(parsed):
        raise InvalidDeviceError(list(devices), hint="each device may appear once")
    return parsed


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of one host.

    Args:
        devices: the replicas' devices. Default: every visible GPU, else the CPU as one replica;
            under ``phalanx run -n N``, N devices. ``["cpu:0", "cpu:1"]`` gives two CPU replicas.
        cross_device_ops: the gradient reduction algorithm: :class:`~phalanx.NcclAllReduce`
            (default), :class:`~phalanx.HierarchicalCopyAllReduce`, :class:`~phalanx.ReductionToOneDevice`.

    Raises:
        InvalidDeviceError: a device is malformed, absent or repeated.
        ClusterSpecError: the launcher started a different number of replicas than ``devices``.
    """

    def __init__(self, devices: Sequence[Any] | None = None, cross_device_ops: CrossDeviceOps | None = None) -> None:
        env = ReplicaEnv.from_environ()
        local = _local_devices(devices, env)
        if env is None and len(local) > 1:
            from phalanx.launch.self_launch import ReplicaLauncher

            self._launcher = ReplicaLauncher(len(local))
            env = self._launcher.env
        if env is not None and env.local_world_size != len(local):
            raise ClusterSpecError("devices", [str(d) for d in local],
                                   f"the launcher started {env.local_world_size} replica processes on this host",
                                   hint="pass as many devices as `phalanx run -n` starts, or none")
        local_rank = env.local_rank if env is not None else 0
        configure_cpu_threads(len(local), local[local_rank].type)
        names = tuple(_tf_name(d) for d in local)
        comm = build_communicator(env, names=tuple(f"replica:{r}" for r in range(env.world_size)) if env else ())
        super().__init__(StrategyExtended(comm, local[local_rank], names, names, cross_device_ops))
        close_at_exit(self)
