"""MirroredStrategy: synchronous training with one replica per local device.

Every replica is a process (see docs/ARCHITECTURE.md). ``python train.py`` starts the other N-1 replica
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
from phalanx.core.extended import tf_device_name
from phalanx.core.strategy import Strategy
from phalanx.launch.launcher import job_env
from phalanx.strategies.common import SyncExtended, local_devices


class MirroredExtended(SyncExtended):
    """The machinery of :class:`MirroredStrategy`: one replica process per local device.

    Args:
        devices: as :class:`MirroredStrategy`'s.
        cross_device_ops: as :class:`MirroredStrategy`'s.
    """

    def __init__(self, devices: Sequence[Any] | None = None, cross_device_ops: CrossDeviceOps | None = None) -> None:
        local = local_devices(devices, job_env())
        env = self._replica_env(local)
        local_rank = env.local_rank if env is not None else 0
        self._select_device(local[local_rank])
        names = tuple(tf_device_name(d) for d in local)
        comm = self._build_communicator(
            env,
            names=tuple(f"replica:{r}" for r in range(env.world_size)) if env else (),
            backend=self._backend_for(local[local_rank]),
            elastic=True,
        )
        self._configure_cpu_threads(comm, local[local_rank].type)
        super().__init__(comm, local[local_rank], names, names, cross_device_ops)
        self._close_at_exit()


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
        super().__init__(MirroredExtended(devices, cross_device_ops))
