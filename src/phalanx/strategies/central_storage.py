"""CentralStorageStrategy: one copy of every variable, computation replicated on every device.

TF places the variables on the CPU and runs a replica of the computation on each GPU. Here each
CPU replica is a process. The parameters live once, in a shared-memory mapping that every
replica's parameters point into, so N replicas hold one copy, not N.

Each step:

1. every replica computes its gradients on its slice of the global batch;
2. the gradients are *reduced to replica 0* (summed);
3. replica 0 alone applies the optimizer update to the central copy. Other replicas drop their
   gradients, so their optimizers skip every parameter and never allocate optimizer state:
   that state exists once, in replica 0, next to the variables;
4. a barrier at the start of the next ``run`` makes the update visible before anyone reads it.

A replica that dies mid-step makes the reduction fail before replica 0 updates anything, so the
central variables keep the last completed step's values.

Example (``train.py``)::

    strategy = phalanx.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        model = torch.nn.Linear(4096, 4096)          # 64 MB, held once for all three replicas
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
"""

from __future__ import annotations

import mmap
import os
import uuid
from typing import Any, Sequence

import torch

from phalanx.comm.communicator import Handle
from phalanx.comm.reducer import GradientReducer
from phalanx.devices import LogicalDevice, canonicalize
from phalanx.errors import InvalidDeviceError
from phalanx.launch.env import ReplicaEnv
from phalanx.strategies.common import (
    build_communicator,
    close_at_exit,
    configure_cpu_threads,
    select_device,
    local_devices,
    replica_env_for,
)
from phalanx.strategy import Strategy, StrategyExtended, _by_dtype, _tf_name

_ALIGN = 64  # bytes; keeps every parameter's data cache-line aligned in the shared mapping


class CentralStorageExtended(StrategyExtended):
    """Variables in one shared copy; gradients reduced to replica 0, which updates them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mappings: list[mmap.mmap] = []  # keep the shared memory mapped while parameters use it
        self._reduced_in_run = 0

    def _sync_new_variables(self) -> None:
        # Only trainable variables are central: non-trainable state (BatchNorm statistics, Keras
        # seed generators) is written by every replica during its forward pass, so it stays
        # per replica (mirrored from replica 0) rather than being raced on in shared memory.
        params = [p for p in self._new_params if p.requires_grad]
        super()._sync_new_variables()
        if params and self._comm.world_size > 1:
            with torch.no_grad():
                self._centralize(params)

    def _centralize(self, params: list[torch.nn.Parameter]) -> None:
        """Moves ``params``' data into one shared mapping per dtype (collective)."""
        comm = self._comm
        for (dtype, _), group in _by_dtype(params).items():
            offsets, size = [], 0
            for p in group:
                offsets.append(size)
                size += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
            key = f"central/{len(self._mappings)}"
            if comm.rank == 0:
                path = f"/dev/shm/phalanx-central-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.ftruncate(fd, max(size, 1))
                comm.store.set(key, path)
            else:
                path = comm.store.get(key).decode()
                fd = os.open(path, os.O_RDWR)
            mapping = mmap.mmap(fd, max(size, 1))
            os.close(fd)
            views = [torch.frombuffer(mapping, dtype=dtype, count=p.numel(), offset=o).view(p.shape)
                     for p, o in zip(group, offsets)]
            if comm.rank == 0:
                for view, p in zip(views, group):
                    view.copy_(p.data)
            comm.barrier()  # everyone has mapped the file, and replica 0 has filled it
            if comm.rank == 0:
                os.unlink(path)  # the mappings keep the memory alive; nothing is left in /dev/shm
            for view, p in zip(views, group):
                p.data = view  # the private copy is freed; module and optimizer keep the same Parameter
            self._mappings.append(mapping)

    def _attach_gradient_sync(self, params: list[torch.nn.Parameter]) -> None:
        comm = self._comm

        def reduce_to_chief(flat: torch.Tensor) -> Handle:
            comm.reduce(flat, dst=0)
            return Handle(flat)

        if self._reducer is None:
            self._reducer = GradientReducer(params, reduce_to_chief, self._bucket_bytes, keep_grads=comm.rank == 0)
        else:
            self._reducer.add(params, self._bucket_bytes)

    def _before_run(self) -> None:
        if self._comm.world_size > 1:
            # Replica 0 may still be applying an update made outside `run` to the shared copy.
            self._comm.barrier()
        self._reduced_in_run = self._reducer.reductions if self._reducer is not None else 0
        super()._before_run()

    def _after_run(self) -> None:
        # When the step's update happened inside `run` (the usual train_step), wait for replica 0
        # to finish it, so every replica reads the updated variables once `run` returns.
        # Every replica ran the same backward passes, so all take this branch together.
        if self._reducer is not None and self._reducer.reductions != self._reduced_in_run:
            self._comm.barrier()


class CentralStorageStrategy(Strategy):
    """Synchronous training with one central copy of the variables.

    Args:
        compute_devices: the replicas' devices. Default: every visible GPU, else the CPU as one
            replica; ``["cpu:0", "cpu:1"]`` gives two CPU replicas.
        parameter_device: where the variables live. Default: the CPU; with exactly one GPU, that GPU.

    Raises:
        InvalidDeviceError: a device is malformed, absent or repeated, or several GPU replicas
            were asked for (their parameters would have to be copied to each GPU every step,
            which phalanx does not do yet).
    """

    def __init__(self, compute_devices: Sequence[Any] | None = None, parameter_device: Any = None) -> None:
        compute = local_devices(compute_devices, ReplicaEnv.from_environ(), "compute_devices")
        if parameter_device is None:
            only_gpu = len(compute) == 1 and compute[0].type == "cuda"
            parameter = compute[0] if only_gpu else LogicalDevice("cpu", 0)
        else:
            parameter = canonicalize(parameter_device)
        if len(compute) > 1 and (parameter.type != "cpu" or any(d.type != "cpu" for d in compute)):
            raise InvalidDeviceError([str(d) for d in compute], hint="CentralStorageStrategy with several replicas "
                                     "supports CPU compute devices and a CPU parameter device")
        env = replica_env_for(self, compute, "compute_devices")
        local_rank = env.local_rank if env is not None else 0
        select_device(compute[local_rank])
        comm = build_communicator(env, names=tuple(f"replica:{r}" for r in range(env.world_size)) if env else ())
        configure_cpu_threads(comm, compute[local_rank].type)
        extended = CentralStorageExtended(comm, compute[local_rank], tuple(_tf_name(d) for d in compute),
                                          (_tf_name(parameter),))
        super().__init__(extended)
        close_at_exit(self)
