"""CentralStorageStrategy: one copy of every variable, computation replicated on every device.

TF places the variables on the CPU and runs a replica of the computation on each GPU. Here each
replica is a process. The trainable parameters live once, in a shared-memory mapping in CPU
memory (the *central copy*), so N replicas hold one copy of the variables, not N.

Each step:

1. every replica computes its gradients on its slice of the global batch;
2. the gradients are summed for replica 0: on one host with the shared-memory transport (the
   usual case; see :mod:`phalanx.comm.shm`) each bucket is *all-reduced* there, a few tens of
   microseconds, and the other replicas drop the sum; without it (``PHALANX_SHM=0``, no
   ``/dev/shm``, a dtype it does not reduce) each bucket is *reduced to replica 0* by gloo, a
   loopback round trip of ~200-600 us;
3. replica 0 alone applies the optimizer update to the central copy. Other replicas drop their
   gradients, so their optimizers skip every parameter and never allocate optimizer state:
   that state exists once, in replica 0, next to the variables;
4. a barrier at the start of the next ``run`` makes the update visible before anyone reads it.

Consistency. The consistency guard (:mod:`phalanx.comm.guard`) also rides on the two barriers
of a step: each is a small all-reduce of the guard's numbers (an all-reduce is a barrier: nobody
leaves it before everyone arrived). For the gradients:

* **Shared memory.** Every replica gets the first bucket's sum, so the guard rides on it as under
  MirroredStrategy: no collective of its own, no extra wait. A replica one step behind (an
  exception its loop caught) pairs its next step's barrier with its peers' first bucket; the
  shared-memory transport sees calls of different sizes, and every call carries the caller's
  step beside its size (the communicator's tag), so every replica raises
  :class:`~phalanx.errors.ReplicaDivergenceError` naming both steps at that collective.
* **Gloo.** Only replica 0 gets the sum of a reduce, so one more small guard all-reduce runs just
  before the first bucket. All three guard all-reduces have the same size, so a replica one step
  behind meets its peers' guard with its own and both raise
  :class:`~phalanx.errors.ReplicaDivergenceError`, instead of pairing a barrier with a reduce and
  waiting for the collective timeout.

How a replica reaches the central copy depends on its compute device:

* **In place** (CPU replicas, CPU parameter device: the default on CPU). Every replica's
  parameters *are* views into the shared mapping, at all times. Nothing is copied.
* **Copy mode** (GPU replicas, CPU parameter device). A replica cannot compute on CPU memory,
  so it keeps a *compute copy* of each central parameter on its device:

  - at the start of every ``run`` the central copy is copied into the compute copy, and each
    parameter's ``.data`` points to the compute copy for the forward and backward passes;
  - each gradient bucket is copied to the CPU and summed there (step 2 above);
  - on replica 0, as soon as the reduction of a backward pass ends (so before the
    ``optimizer.step()`` of a usual train step), each parameter's ``.data`` becomes its central
    CPU view and its ``.grad`` the summed CPU gradient: the optimizer updates the central copy
    and creates its state once, on the CPU;
  - when ``run`` returns (after the barrier that waits for replica 0's update), every replica's
    parameters point to the central copy again.

  What the user sees: *outside* ``run``, on every replica, trainable parameters are the central
  copy on the CPU, holding the latest values: reading them (saving a checkpoint, comparing,
  ``strategy.reduce`` of values derived from them) is correct everywhere, and writing them
  (restoring a checkpoint, which also puts restored optimizer state on the CPU) changes the one
  copy. *Inside* ``run``, a replica computes on its compute copy; on replica 0 the parameters
  are the central CPU copy after ``backward()`` returns, so run a forward pass that must use the
  updated values in the next ``run``. Non-trainable state (buffers, frozen parameters) stays on
  each replica's device, as in place mode keeps it per replica.

  ``PHALANX_CENTRAL_COPY=1`` in the environment forces copy mode on CPU replicas (compute
  copies in private CPU memory). It is a testing aid: it runs the copy-mode code path on a host
  without GPUs. Every replica must see the same value (the rendezvous checks it).

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
from typing import Any, Callable, Sequence

import torch

from phalanx.comm.communicator import Handle
from phalanx.comm.flight_recorder import recording
from phalanx.comm.reducer import GradientReducer
from phalanx.comm.shm import DTYPES as SHM_DTYPES
from phalanx.config import settings
from phalanx.core import capture
from phalanx.core.cross_replica import by_dtype
from phalanx.core.extended import tf_device_name
from phalanx.core.gradient_sync import GradientSync, ReducerSync
from phalanx.core.strategy import Strategy
from phalanx.devices import LogicalDevice, canonicalize
from phalanx.errors import InvalidDeviceError
from phalanx.launch.launcher import job_env
from phalanx.strategies.common import SyncExtended, local_devices

_ALIGN = 64  # bytes; keeps every parameter's data cache-line aligned in the shared mapping
_CENTRAL_DEVICE = torch.device("cpu")  # the central copy is CPU memory (a shared mapping)


def _forced_copy_mode() -> bool:
    return settings().central_copy  # PHALANX_CENTRAL_COPY, checked to be 0 or 1


def _point(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """Makes ``param`` use ``data`` as its storage; a gradient it holds follows it to that device."""
    if param.data.data_ptr() == data.data_ptr() and param.device == data.device:
        return
    grad = param.grad
    if grad is not None:
        param.grad = None  # a .grad on another device than .data is refused
    param.data = data
    if grad is not None:
        param.grad = grad.to(data.device)


class _CopyModeReducer(GradientReducer):
    """A :class:`GradientReducer` that hands the summed buckets to ``on_reduced`` (copy mode).

    It drops every replica's own gradients (``keep_grads=False``): in copy mode they live on the
    compute device, while the summed gradient that replica 0 keeps lives on the CPU, next to the
    central copy. ``on_reduced`` receives ``[(bucket parameters, summed flat tensor), ...]``
    once per completed backward pass; replica 0 uses it to point the parameters at the central
    copy and to set their ``.grad``.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        reduce: Callable[[torch.Tensor], Any],
        bucket_bytes: int,
        on_reduced: Callable[[list[tuple[list[torch.nn.Parameter], torch.Tensor]]], None] | None,
        **guarding: Any,
    ) -> None:
        self._on_reduced = on_reduced
        self._launched: list[tuple[Any, Any]] = []  # (bucket, its handle)
        super().__init__(params, reduce, bucket_bytes, keep_grads=False, persistent=False, **guarding)

    def _launch(self, bucket: Any) -> None:
        super()._launch(bucket)
        self._launched.append((bucket, bucket.handle))

    def _finish(self) -> None:
        launched, before = self._launched, self.reductions
        try:
            super()._finish()
            # A failed reduction raised above: replica 0's parameters keep the last step's values.
            if self._on_reduced is not None and self.reductions != before:
                self._on_reduced(
                    [
                        ([p for i, p in enumerate(bucket.params) if i not in bucket.unused_everywhere], handle.wait())
                        for bucket, handle in launched
                    ]
                )
        finally:
            self._launched = []


class Central(ReducerSync):
    """CentralStorage's gradient synchronisation: one shared copy of the trainable variables, the
    gradients summed for replica 0, which alone updates that copy (see the module docstring).

    Args:
        comm: the communicator among the replicas.
        copy_mode: replicas compute on copies of the central variables (GPU replicas).
        bucket_bytes: the gradient buckets' target size.
        guard: the consistency guard, or None.
    """

    def __init__(self, comm: Any, copy_mode: bool, bucket_bytes: int, guard: Any) -> None:
        self._comm = comm
        self._copy_mode = copy_mode
        self._bucket_bytes = bucket_bytes
        self._guard = guard
        self.reducer: GradientReducer | None = None
        self._mappings: list[mmap.mmap] = []  # keep the shared memory mapped while parameters use it
        self._reduced_in_run = 0
        self._all_reduce_buckets = False  # gradient buckets go by shared-memory all-reduce, not gloo's reduce
        # Copy mode: (parameter, central CPU view, compute copy on the replica's device).
        self._copies: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
        self._central_of: dict[int, torch.Tensor] = {}  # id(parameter) -> its central view

    def central_copy_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self._central_of[id(param)]

    # ---------------------------------------------------------------- variables
    def attach(self, params: list[torch.nn.Parameter]) -> None:
        # Only trainable variables are central: non-trainable state (BatchNorm statistics, Keras
        # seed generators) is written by every replica during its forward pass, so it stays
        # per replica (mirrored from replica 0) rather than being raced on in shared memory.
        # Created frozen, a parameter stays per replica until it thaws (adopt_thawed: the same).
        self._attach_reducer(params)
        # (An empty one has nothing to share: a lazy module's placeholder before its real parameter.)
        trainable = [p for p in params if p.requires_grad and p.numel() > 0]
        # Alone, and computing where the variables are, a replica's own copy is the central one.
        if trainable and (self._comm.world_size > 1 or self._copy_mode):
            with torch.no_grad():
                self._centralize(trainable)

    def _centralize(self, params: list[torch.nn.Parameter]) -> None:
        """Moves ``params``' data into one shared mapping per dtype (collective).

        In copy mode each parameter's former data is kept as its compute copy.
        """
        comm = self._comm
        for (dtype, _), group in by_dtype(params).items():
            offsets, size = [], 0
            for p in group:
                offsets.append(size)
                size += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
            key = f"central/{len(self._mappings)}"
            path = None
            try:
                if comm.world_size == 1:
                    mapping = mmap.mmap(-1, max(size, 1))  # nobody to share with: anonymous memory
                else:
                    if comm.rank == 0:
                        path = f"/dev/shm/phalanx-central-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                        os.ftruncate(fd, max(size, 1))
                        comm.store.set(key, path)
                    else:
                        fd = os.open(comm.store.get(key).decode(), os.O_RDWR)
                    mapping = mmap.mmap(fd, max(size, 1))
                    os.close(fd)
                views = [
                    torch.frombuffer(mapping, dtype=dtype, count=p.numel(), offset=o).view(p.shape)
                    for p, o in zip(group, offsets)
                ]
                if comm.rank == 0:
                    for view, p in zip(views, group):
                        view.copy_(p.data)
                comm.barrier()  # everyone has mapped the file, and replica 0 has filled it
            finally:
                if path is not None:
                    # The mappings keep the memory alive: nothing is left in /dev/shm, also when a
                    # peer failed before mapping it (the barrier raised).
                    os.unlink(path)
            for view, p in zip(views, group):
                if self._copy_mode:
                    # The former data becomes the compute copy; refreshed at every `run`.
                    self._copies.append((p, view, p.data))
                    self._central_of[id(p)] = view
                # Outside `run` (and always in place mode) the parameter is the central copy.
                # In place mode the private copy is freed; module and optimizer keep the same Parameter.
                p.data = view
            self._mappings.append(mapping)

    def _attach_reducer(self, params: list[torch.nn.Parameter]) -> None:
        comm = self._comm
        if self.reducer is None:
            # Decided once, with the first bucket (the one the guard rides on): see the module docstring.
            self._all_reduce_buckets = (
                comm.world_size > 1
                and getattr(comm, "shared_memory", False)
                and all(p.dtype in SHM_DTYPES for p in params if p.requires_grad)
            )

        def reduce_to_chief(flat: torch.Tensor) -> Handle:
            # Copy mode: the sum is made, and kept, on the CPU next to the central copy (a no-op
            # for CPU replicas; a device-to-host copy of the bucket for GPU replicas).
            flat = flat.to(_CENTRAL_DEVICE) if self._copy_mode else flat
            if comm.world_size == 1:
                return Handle(flat)
            if self._all_reduce_buckets and flat.dtype in SHM_DTYPES:
                # Every replica gets the sum (the others drop it): faster than gloo's reduce on one host.
                return comm.all_reduce(flat, "sum")
            comm.reduce(flat, dst=0)
            return Handle(flat)

        rec = getattr(comm, "recorder", None)
        if rec is not None:  # the flight recorder calls these collectives gradient buckets
            reduce_to_chief = rec.labelled("gradient bucket", reduce_to_chief)
        # The guard rides on the first bucket where every replica gets its sum; where only replica 0
        # gets it (gloo's reduce), it has a small all-reduce of its own just before that bucket.
        guarding = {
            "guard": self._guard,
            "guard_collective": None if self._all_reduce_buckets else self._exchange_guard,
            "name_of": capture.label_of,
        }
        if self.reducer is not None:
            self.reducer.add(params, self._bucket_bytes)
        elif self._copy_mode:
            self.reducer = _CopyModeReducer(
                params, reduce_to_chief, self._bucket_bytes, self._adopt_reduced if comm.rank == 0 else None, **guarding
            )
        else:
            # A bucket buffer per pass, not kept: a persistent one would hold a gradient-sized buffer
            # on every replica, against this strategy's point of one copy of the model's state.
            self.reducer = GradientReducer(
                params, reduce_to_chief, self._bucket_bytes, keep_grads=comm.rank == 0, persistent=False, **guarding
            )

    def _exchange_guard(self, guard: Any, with_parameters: bool = True) -> None:
        """Every replica's guard numbers in one small all-reduce; raises if the replicas disagree."""
        # A copy: the guard reuses its buffer, and the all-reduce works in place.
        mine = guard.encode(torch.int64, _CENTRAL_DEVICE, with_parameters=with_parameters).clone()
        with recording(self._comm, "guard"):
            summed = self._comm.all_reduce(mine, "sum").wait()
        guard.verify(summed)

    def _barrier(self) -> None:
        """A barrier that carries the consistency guard when it is on (see the module docstring).

        Either way it is a small all-reduce (nobody leaves it before everyone arrived): on one host
        that goes through shared memory, a few microseconds, where gloo's barrier is a loopback
        round trip. So the guard's cost is what it adds, not a change of transport.
        """
        if self._guard is not None:
            # No fingerprint here: replica 0 may still be writing an update into the shared copy
            # (the reason for this barrier). The first gradient bucket (or, on gloo, the guard
            # all-reduce just before it) carries it.
            self._exchange_guard(self._guard, with_parameters=False)
        elif self._comm.world_size > 1:
            with recording(self._comm, "barrier"):
                self._comm.all_reduce(torch.zeros(1, dtype=torch.int64), "sum").wait()

    def _adopt_reduced(self, buckets: list[tuple[list[torch.nn.Parameter], torch.Tensor]]) -> None:
        """Replica 0, copy mode: the optimizer is to update the central copy with the summed gradients.

        ``buckets`` lists, per bucket, the parameters some replica used (one that no replica used
        keeps no gradient, as on one device) with the bucket's sum.
        """
        for params, flat in buckets:
            for p in params:
                offset, n = self.reducer.offset_of(p), p.numel()  # type: ignore[union-attr]
                grad = flat[offset : offset + n].view(p.shape)
                central = self._central_of.get(id(p))
                if central is not None:
                    _point(p, central)
                p.grad = grad if grad.device == p.device else grad.to(p.device)

    # ---------------------------------------------------------------- the step
    def before_run(self) -> None:
        if self._comm.world_size > 1:
            # Replica 0 may still be applying an update made outside `run` to the shared copy.
            self._barrier()
        self._reduced_in_run = self.reducer.reductions if self.reducer is not None else 0

    def enter_step(self) -> None:
        if self._copies:
            with torch.no_grad():
                for p, central, compute in self._copies:
                    compute.copy_(central)
                    _point(p, compute)

    def after_run(self) -> None:
        # When the step's update happened inside `run` (the usual train_step), wait for replica 0
        # to finish it, so every replica reads the updated variables once `run` returns.
        # Every replica ran the same backward passes, so all take this branch together.
        if self.reducer is not None and self.reducer.reductions != self._reduced_in_run:
            self._barrier()
        # Copy mode: outside `run` the parameters are the central copy again, so that reading
        # them gives the latest values and writing them (a restore) changes the one copy.
        for p, central, _ in self._copies:
            _point(p, central)

    # The rest of the contract (no_sync, scaled, parameters, the guard, close): ReducerSync's.


class CentralStorageExtended(SyncExtended):
    """Variables in one shared copy; gradients reduced to replica 0, which updates them.

    Args:
        compute_devices, parameter_device: as :class:`CentralStorageStrategy`'s. Copy mode
            (computing on per-replica copies of the central variables) follows from them; see
            the module docstring.
    """

    def __init__(self, compute_devices: Sequence[Any] | None = None, parameter_device: Any = None) -> None:
        compute = local_devices(compute_devices, job_env(), "compute_devices")
        if parameter_device is None:
            only_gpu = len(compute) == 1 and compute[0].type == "cuda"
            parameter = compute[0] if only_gpu else LogicalDevice("cpu", 0)
        else:
            parameter = canonicalize(parameter_device)
        if len({d.type for d in compute}) > 1:
            raise InvalidDeviceError(
                [str(d) for d in compute],
                hint="CentralStorageStrategy's compute devices must all be CPUs or all be GPUs",
            )
        if parameter.type != "cpu" and [parameter] != compute:
            raise InvalidDeviceError(
                str(parameter),
                hint="CentralStorageStrategy keeps the variables on the CPU, "
                "or on the GPU of its only replica; use parameter_device='cpu'",
            )
        # Copy mode whenever a replica cannot compute on the central (CPU) memory itself.
        self._copy_mode = copy_mode = parameter.type == "cpu" and (compute[0].type != "cpu" or _forced_copy_mode())
        env = self._replica_env(compute, "compute_devices")
        local_rank = env.local_rank if env is not None else 0
        self._select_device(compute[local_rank])
        comm = self._build_communicator(
            env,
            names=tuple(f"replica:{r}" for r in range(env.world_size)) if env else (),
            fingerprint=(("central_storage_copy_mode", copy_mode),),
            # Copy mode reduces on the central CPU variables (shared memory, gloo); NCCL serves the
            # GPU tensors a user reduces (strategy.reduce of a loss on the replica's GPU).
            backend=self._backend_for(compute[local_rank]),
        )
        self._configure_cpu_threads(comm, compute[local_rank].type)
        super().__init__(
            comm, compute[local_rank], tuple(tf_device_name(d) for d in compute), (tf_device_name(parameter),)
        )
        self._close_at_exit()

    def _make_gradient_sync(self) -> GradientSync:
        # One replica computing where its variables are needs nothing (unless its process group is
        # built anyway, PHALANX_SINGLE_REPLICA_COLLECTIVES: the path a job of several runs); one
        # in copy mode (a GPU replica, variables on the CPU) still hands its gradients to the
        # central copy.
        if not self._collectives and not self._copy_mode:
            return GradientSync()
        return Central(self._comm, self._copy_mode, self._bucket_bytes, self.consistency.active)

    @property
    def copy_mode(self) -> bool:
        """Whether replicas compute on copies of the central variables (see the module docstring)."""
        return self._copy_mode

    @property
    def updates_on_chief_only(self) -> bool:
        """Whether the chief alone receives the summed gradients and applies the update (several replicas).

        After ``backward()`` the other replicas' trainable parameters have no gradient: an
        optimizer there must skip its update. torch's optimizers skip parameters without a
        gradient by themselves; :mod:`phalanx.keras` makes Keras' optimizers skip it too.
        """
        return self._comm.world_size > 1

    def central_copy_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Copy mode: the central (shared CPU) view of ``param``.

        Raises:
            KeyError: ``param`` is not a central variable of this strategy in copy mode.
        """
        sync = self.gradient_sync
        if not isinstance(sync, Central):
            raise KeyError(param)
        return sync.central_copy_of(param)


class CentralStorageStrategy(Strategy):
    """Synchronous training with one central copy of the variables.

    Args:
        compute_devices: the replicas' devices, all CPUs or all GPUs. Default: every visible GPU,
            else the CPU as one replica; ``["cpu:0", "cpu:1"]`` gives two CPU replicas.
        parameter_device: where the variables live: the CPU, or the replica's GPU when there is
            one replica. Default: the CPU; with exactly one GPU, that GPU. When it differs from
            the compute devices (GPU replicas), each replica computes on a copy of the variables
            refreshed at every ``run`` (copy mode, see the module docstring).

    Raises:
        InvalidDeviceError: a device is malformed, absent or repeated, the compute devices mix
            CPUs and GPUs, or the parameter device is a GPU other than the one replica's device.
        ClusterSpecError: ``PHALANX_CENTRAL_COPY`` is set to something other than 0 or 1.
    """

    def __init__(self, compute_devices: Sequence[Any] | None = None, parameter_device: Any = None) -> None:
        super().__init__(CentralStorageExtended(compute_devices, parameter_device))
