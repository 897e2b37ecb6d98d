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

from phalanx.comm.cross_device_ops import CrossDeviceOps
from phalanx.strategies.common import (
    build_communicator,
    close_at_exit,
    configure_cpu_threads,
    job_env,
    select_device,
    local_devices,
    replica_env_for,
)
from phalanx.strategy import Strategy, StrategyExtended, _tf_name


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
        local = local_devices(devices, job_env())
        env = replica_env_for(self, local)
        local_rank = env.local_rank if env is not None else 0
        select_device(local[local_rank])
        names = tuple(_tf_name(d) for d in local)
        comm = build_communicator(env, names=tuple(f"replica:{r}" for r in range(env.world_size)) if env else ())
        configure_cpu_threads(comm, local[local_rank].type)
        super().__init__(StrategyExtended(comm, local[local_rank], names, names, cross_device_ops))
        close_at_exit(self)
