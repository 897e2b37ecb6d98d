"""Distributed datasets: every replica gets its slice of each global batch.

``experimental_distribute_dataset(dataset)`` takes any iterable of *global* batches: a torch
``DataLoader``, a list of tensors or numpy arrays, or nested tuples / dicts of them. Each element
is split along its first dimension: replica ``r`` of ``N`` gets rows
``[r * B // N, (r + 1) * B // N)`` in the ``torch.tensor_split`` sense (the first ``B % N``
replicas get one row more).

Partial batches. A global batch smaller than the number of replicas is split as far as it goes,
as TF splits it: replicas past its end get an empty slice (zero rows) and still take part in the
step, so nothing hangs and no sample is dropped. :func:`phalanx.nn.compute_average_loss` divides
by the actual global batch size. When the *first* batch is that small, :class:`SmallBatchWarning`
says so once (a batch size meant per replica, passed as global, is the usual cause).

Pipelines from a function (``distribute_datasets_from_function``), as TF feeds them. By default
``dataset_fn`` builds one pipeline per *worker* (``InputContext(num_input_pipelines=workers,
input_pipeline_id=worker)``), whose elements go to the worker's replicas in turn: replica ``k`` of
the worker's ``N`` gets elements ``k``, ``k + N``, ... (TF's multi-device iterator). Each replica
being a process, every process of the worker calls ``dataset_fn`` and reads the whole stream,
drawn with the same seeds (see below), and keeps its elements; the first elements of each pass are
compared across the worker's processes. ``InputReplicationMode.PER_REPLICA`` builds one pipeline
per replica process instead (no element read twice). Elements need no batch dimension: a
replica then gets one element (a scalar, say) per step.

Pipelines may run out at different steps; each step the processes agree collectively whether
anyone still has data. Replicas without an element feed TF's dummy value (the batch dimension cut
to 0; a scalar 0) until every pipeline is exhausted, so all replicas stop at the same step with
identical parameters. Elements without a batch dimension on one worker end at the first step
where a replica has none (TF drops that partial step for statically shaped elements).

Same global batches everywhere. Every process reads the dataset given to
``experimental_distribute_dataset`` and keeps its slice, so every process must read the same
global batches. An unseeded shuffle (``DataLoader(shuffle=True)``, ``random.shuffle`` or numpy in
a generator) would shuffle differently in each process; so ``iter()`` and every batch of a pass
are drawn with torch's, numpy's and Python's global random generators seeded from the chief (one
seed per pass, sent once; batch ``i`` uses seed + i), and each process's own random state is given
back afterwards. Randomness from elsewhere (a generator's own ``np.random.default_rng()``, data
that depends on the process) cannot be aligned this way: the first global batches of every pass
are compared across processes and a difference raises
:class:`~phalanx.errors.InputMismatchError` on every replica.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import warnings
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np
import torch

from phalanx import nest
from phalanx.comm.flight_recorder import recording
from phalanx.errors import InputMismatchError, PhalanxError
from phalanx.input import global_batch
from phalanx.input.element_spec import Optional, spec_of
from phalanx.input.input_context import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode
from phalanx.values import local_results

# The first global batches of each pass that are compared across processes.
CHECKED_BATCHES = 2
_END = object()


class Strategy(Protocol):
    """What a distributed dataset needs of its strategy (``phalanx.Strategy`` provides it): input/
    depends on this much, not on the strategy module, which imports input/."""

    @property
    def extended(self) -> Any: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, options: Any = None) -> Any: ...

    def _wrap_local(self, structure: Any) -> Any: ...


class UnbatchedElementError(PhalanxError, IndexError, ValueError):
    """A dataset element without a batch dimension where a batch is needed.

    ``experimental_distribute_dataset`` splits global batches, so its elements must be batches;
    TF raises IndexError there (its rebatching reads the batch dimension), hence the base class.
    """

    def __init__(self, element: Any) -> None:
        self.element = element
        super().__init__(
            f"A batch must contain at least one tensor with a batch dimension; received {element!r:.200}",
            hint="batch the dataset (e.g. DataLoader(batch_size=...)), or give unbatched elements to "
            "distribute_datasets_from_function, which feeds each replica one element per step",
        )


def _to_tensor(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(leaf)
    return leaf


def _to_element(leaf: Any) -> Any:
    """Arrays and Python / numpy numbers become tensors, as every element of a tf.data pipeline is one."""
    if isinstance(leaf, (bool, int, float, np.number, np.bool_)):
        return torch.as_tensor(leaf)
    return _to_tensor(leaf)


class SmallBatchWarning(UserWarning):
    """The first global batch is smaller than the number of replicas: some replicas get empty batches."""


def batch_size_of(element: Any) -> int:
    """The leading dimension shared by every tensor of a batch.

    Raises:
        UnbatchedElementError: no tensor of ``element`` has a batch dimension.
    """
    sizes = {int(t.shape[0]) for t in nest.flatten(element) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not sizes:
        raise UnbatchedElementError(element)
    if len(sizes) > 1:
        raise ValueError(f"The tensors of one batch have different first dimensions: {sorted(sizes)}.")
    return sizes.pop()


def _examples_in(element: Any) -> tuple[int, bool]:
    """``(examples, unbatched)``: the batch dimension, or ``(1, True)`` where every tensor is a scalar."""
    tensors = [t for t in nest.flatten(element) if isinstance(t, torch.Tensor)]
    if tensors and all(t.dim() == 0 for t in tensors):
        return 1, True
    return batch_size_of(element), False


def _cut_batch(element: Any) -> Any:
    """An empty batch shaped like ``element`` (scalars kept as they are)."""
    return nest.map_structure(lambda t: t[:0] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, element)


def _dummy(element: Any) -> Any:
    """TF's stand-in for a replica without an element (input_lib's ``_dummy_tensor_fn``): the batch
    dimension cut to 0, a scalar 0."""
    return nest.map_structure(
        lambda t: (t[:0] if t.dim() > 0 else torch.zeros_like(t)) if isinstance(t, torch.Tensor) else t, element
    )


def slice_bounds(batch_size: int, num: int, index: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of the ``index``-th of ``num`` near-equal parts of a batch."""
    base, extra = divmod(batch_size, num)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class _Placer:
    """Moves batches to the replica's device, one batch ahead (overlaps the copy on GPUs)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.enabled = enabled and device.type != "cpu"

    def __call__(self, element: Any) -> Any:
        if not self.enabled:
            return element
        return nest.map_structure(
            lambda t: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, element
        )


class DistributedIterator:
    """Iterator over per-replica batches (``tf.distribute.DistributedIterator``).

    ``next()`` / ``get_next()`` raise ``StopIteration`` at the end (TF: ``OutOfRangeError``);
    ``get_next_as_optional()`` returns an :class:`~phalanx.input.element_spec.Optional` instead. The end is
    the same step on every replica.
    """

    def __init__(self, source: Iterator[Any], strategy: "Strategy") -> None:
        self._source = source
        self._strategy = strategy
        self._peeked: Any = _END
        self._spec: Any = None
        # An elastic job's replacement catches this iterator up with the group's when it joins.
        self._elastic = bool(getattr(strategy.extended, "elastic", False))

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        if self._peeked is not _END:
            value, self._peeked = self._peeked, _END
            if self._elastic:
                global_batch.remember_iterator(value, self)
            return value
        value = next(self._source)
        if self._spec is None:
            self._spec = _local_spec(value)
        if self._elastic:
            global_batch.remember_iterator(value, self)
        return value

    def get_next(self) -> Any:
        return next(self)

    def get_next_as_optional(self) -> Optional:
        """The next element as an Optional that is empty at the end of the data."""
        value = next(self, _END)
        return Optional.empty() if value is _END else Optional.from_value(value)

    @property
    def element_spec(self) -> Any:
        """The :class:`~phalanx.input.element_spec.TensorSpec` structure of this replica's batches
        (reads the first batch if none was read yet)."""
        if self._spec is None and self._peeked is _END:
            self._peeked = next(self._source, _END)
            if self._peeked is not _END:
                self._spec = _local_spec(self._peeked)
        return self._spec


def _local_spec(value: Any) -> Any:
    return spec_of(nest.map_structure(lambda v: local_results(v)[0], value))


def shared_seed(ext: Any) -> int | None:
    """A seed drawn by the chief and sent to every process (a collective); None for one process."""
    if ext.num_processes == 1:
        return None
    seed_t = torch.tensor([secrets.randbits(62) if ext.process_index == 0 else 0], dtype=torch.int64)
    ext.broadcast([seed_t])
    return int(seed_t[0])


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Inside, torch's (CPU), numpy's and Python's global generators draw from ``seed``; the
    process's own random state is given back after. Nothing happens for ``seed=None``."""
    if seed is None:
        yield
        return
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def seeded_elements(dataset: Iterable[Any], seed: int | None) -> Iterator[Any]:
    """The elements of one pass over ``dataset``: ``iter()`` drawn under ``seed``, element ``i``
    under ``seed + i + 1`` (so random numbers a pipeline draws as it goes, a DataLoader's shuffle
    order or a generator's np.random, are the same in every process given the same seed)."""
    with seeded(seed):
        iterator = iter(dataset)
    i = 0
    while True:
        with seeded(None if seed is None else seed + i + 1):
            element = next(iterator, _END)
        if element is _END:
            return
        yield element
        i += 1


def _worker_seed(seed: int | None, worker: int) -> int | None:
    """The chief's seed, made different per worker (each worker's pipeline shuffles its own way)."""
    return None if seed is None else (seed + worker * 0x9E3779B97F4A7C15) % 2**62


def _fingerprint(element: Any) -> float:
    """A number that differs, with high probability, between two different batches (order included)."""
    total = 0.0
    for t in nest.flatten(element):
        if isinstance(t, torch.Tensor) and t.numel():
            flat = torch.nan_to_num(t.detach().reshape(-1)[:4096].to("cpu", torch.float64))
            total += float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum()) + t.numel()
    return total


def check_same_batch(ext: Any, element: Any, index: int) -> None:
    """Raises :class:`InputMismatchError` on every replica if the processes' global batches differ.

    Batches of different sizes are left to the consistency guard of the step that follows, which
    names both replicas and both sizes (``ReplicaDivergenceError``, field "global batch size").
    """
    f, size = _fingerprint(element), float(batch_size_of(element))
    with recording(ext.communicator, "input check"):
        both = ext.communicator.all_reduce(torch.tensor([f, -f, size, -size], dtype=torch.float64), "max").wait()
    if float(both[2]) != -float(both[3]):
        return
    if float(both[0]) != -float(both[1]):
        raise InputMismatchError(
            f"The processes read different global batches (batch {index} of this pass; on "
            f"{ext.process_name()} its fingerprint is {f:.6g}, the largest is {float(both[0]):.6g}).",
            hint="every process must produce the same global batches: seed the shuffling (e.g. "
            "DataLoader(generator=torch.Generator().manual_seed(epoch))), or give each process its own "
            "data with distribute_datasets_from_function and "
            "InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)",
        )


def check_same_stream(ext: Any, elements: list[Any], groups: int, group: int) -> None:
    """Raises :class:`InputMismatchError` on every replica if the processes of one worker read
    different elements (each worker's processes must read its pipeline alike; workers may differ).

    One collective: each worker's fingerprints in their own slots, the max of ``f`` and of ``-f``
    over the job, so a worker agrees exactly when both give the same number.
    """
    f = sum((i + 1) * _fingerprint(e) for i, e in enumerate(elements)) + len(elements)
    slots = torch.full((2 * groups,), float("-inf"), dtype=torch.float64)
    slots[2 * group], slots[2 * group + 1] = f, -f
    with recording(ext.communicator, "input check"):
        both = ext.communicator.all_reduce(slots, "max").wait()
    if any(float(both[2 * w]) != -float(both[2 * w + 1]) for w in range(groups)):
        raise InputMismatchError(
            f"The processes of one worker read different elements from its dataset_fn's pipeline (the first "
            f"elements of this pass; on {ext.process_name()} their fingerprint is {f:.6g}).",
            hint="every process of a worker must build the same pipeline: seed its random numbers from the "
            "global generators (torch/numpy/random, which phalanx aligns), or pass "
            "InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA) for one pipeline "
            "per replica (dataset_fn then shards by input_pipeline_id)",
        )


class DistributedDataset:
    """An iterable of per-replica batches, made from an iterable of global batches."""

    def __init__(self, strategy: "Strategy", dataset: Iterable[Any], options: InputOptions | None = None) -> None:
        if not hasattr(dataset, "__iter__"):
            raise TypeError(
                f"experimental_distribute_dataset needs an iterable of batches; received {type(dataset).__name__}"
            )
        self._strategy = strategy
        self._options = options or InputOptions()
        ext = strategy.extended
        workers = ext.input_sharding.num_workers
        local_world = strategy.num_replicas_in_sync // workers
        policy = self._options.auto_shard_policy
        shardable = callable(getattr(dataset, "shard", None))
        # (number of parts, index of ours) each batch read by this process is split into
        if workers > 1 and policy is AutoShardPolicy.FILE and not shardable:
            raise ValueError(
                f"AutoShardPolicy.FILE needs a dataset with a shard(num_shards, index) method; "
                f"received {type(dataset).__name__}. Use AutoShardPolicy.DATA to split batches."
            )
        # An elastic job's replicas read every global batch and cut their part, so that a step run
        # again on a re-formed group cuts the same batch into new parts (no example lost or repeated).
        self._elastic = bool(getattr(ext, "elastic", False))
        if self._elastic:
            self._split = (strategy.num_replicas_in_sync, ext.process_index)
        elif workers > 1 and policy in (AutoShardPolicy.AUTO, AutoShardPolicy.FILE) and shardable:
            dataset = dataset.shard(workers, ext.input_sharding.worker_index)  # type: ignore[attr-defined]
            self._split = (local_world, ext.process_index % local_world)
        elif workers > 1 and policy is AutoShardPolicy.OFF:
            self._split = (local_world, ext.process_index % local_world)
        else:
            self._split = (strategy.num_replicas_in_sync, ext.process_index)
        self._dataset = dataset

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._generate(), self._strategy)

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]

    @property
    def element_spec(self) -> Any:
        """The :class:`~phalanx.input.element_spec.TensorSpec` structure of a replica's batch (reads one batch)."""
        first = next(iter(self._dataset), _END)
        return None if first is _END else spec_of(nest.map_structure(_to_tensor, first))

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Folds ``reduce_func(state, per_replica_batch)`` over the dataset (TF's ``reduce``)."""
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def _passes(self) -> Iterator[Any]:
        """The global batches of one pass, the same in every process (see the module docstring)."""
        ext = self._strategy.extended
        check = ext.num_processes > 1 and self._split[0] == self._strategy.num_replicas_in_sync
        for i, element in enumerate(seeded_elements(self._dataset, shared_seed(ext))):
            element = nest.map_structure(_to_tensor, element)
            if check and i < CHECKED_BATCHES:
                check_same_batch(ext, element, i)
            yield element

    def _slices(self) -> Iterator[tuple[Any, int]]:
        num, index = self._split
        elastic = self._elastic
        first = True
        for element in self._passes():
            if elastic:  # the group may have changed since the last batch: cut by the current one
                num, index = self._strategy.num_replicas_in_sync, self._strategy.extended.process_index
            size = batch_size_of(element)
            if first and size < num:
                warnings.warn(
                    f"The first global batch has {size} example(s) for {num} replicas: replicas past its end get "
                    "empty batches, as in TF. If the batch size was meant per replica, pass the global one "
                    f"(per-replica size x {num}).",
                    SmallBatchWarning,
                    stacklevel=3,
                )
            first = False
            start, end = slice_bounds(size, num, index)
            local = nest.map_structure(
                lambda t: t[start:end] if isinstance(t, torch.Tensor) and t.dim() > 0 else t,  # noqa: B023 - applied now
                element,
            )
            if elastic:
                global_batch.remember_sources(local, element, (num, index))
            yield local, size

    def _generate(self) -> Iterator[Any]:
        ext = self._strategy.extended
        place = _Placer(ext.device, self._options.experimental_fetch_to_device)
        whole = self._split[0] == self._strategy.num_replicas_in_sync  # every process reads whole global batches
        if ext.input_sharding.agree_on_end and not self._elastic:  # an elastic job reads the same batches everywhere
            sliced = [0]  # the size of the last batch this process sliced, for the consistency guard

            def elements() -> Iterator[Any]:
                for element, size in self._slices():
                    sliced[0] = size
                    yield element

            source = ((e, g, sliced[0] if whole else None) for e, g in _agreed(ext, elements()))
        else:
            source = ((e, g, g) for e, g in self._slices())
        yield from _emit(self._strategy, source, place)


class DatasetFromFunction:
    """The pipelines ``dataset_fn(InputContext)`` builds, one per worker (TF's default) or one per
    replica (``InputReplicationMode.PER_REPLICA``), fed to the replicas as TF feeds them; see the
    module docstring."""

    def __init__(
        self,
        strategy: "Strategy",
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> None:
        self._strategy = strategy
        self._options = options or InputOptions()
        ext = strategy.extended
        replicas = strategy.num_replicas_in_sync
        sharding = ext.input_sharding
        workers = max(sharding.num_workers, 1)
        # The processes of each worker (a parameter-server chief is one process for several replicas).
        per_worker = max(ext.num_processes // workers, 1)
        self._groups, self._group = workers, sharding.worker_index
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            self._context = InputContext(replicas, ext.process_index, replicas)
            self._share = (1, 0)
        else:
            self._context = InputContext(workers, sharding.worker_index, replicas)
            self._share = (per_worker, ext.process_index % per_worker)
        # Replicas of one worker share its pipeline: build it from the same random numbers.
        seed = _worker_seed(shared_seed(ext), self._group) if self._share[0] > 1 else None
        with seeded(seed):
            self._dataset = dataset_fn(self._context)

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._generate(), self._strategy)

    @property
    def element_spec(self) -> Any:
        """The :class:`~phalanx.input.element_spec.TensorSpec` structure of this pipeline's elements (reads one)."""
        first = next(iter(self._dataset), _END)
        return None if first is _END else spec_of(nest.map_structure(_to_element, first))

    def _rounds(self) -> Iterator[list[Any]]:
        """The pipeline's elements, ``N`` at a time for the worker's ``N`` replicas (one step each).

        Every process of a worker reads the same rounds, so every process makes the same
        collectives in the same order, whichever of the round's elements is its own.
        """
        ext = self._strategy.extended
        num = self._share[0]
        seed = _worker_seed(shared_seed(ext), self._group) if num > 1 else None
        elements = (nest.map_structure(_to_element, e) for e in seeded_elements(self._dataset, seed))
        first = True
        while True:
            chunk = [e for _, e in zip(range(num), elements)]
            if num > 1 and first:
                check_same_stream(ext, chunk, self._groups, self._group)  # every process, once per pass
            first = False
            if not chunk:
                return
            yield chunk

    def _generate(self) -> Iterator[Any]:
        ext = self._strategy.extended
        place = _Placer(ext.device, self._options.experimental_fetch_to_device)
        index = self._share[1]
        seen: list[Any] = []  # an element of the latest round: the shape of a replica's dummy

        def mine() -> Iterator[Any]:
            for chunk in self._rounds():
                seen[:] = chunk[:1]
                if index >= len(chunk):
                    return
                yield chunk[index]

        agreed = _agreed(
            ext,
            mine(),
            template=lambda: seen[0] if seen else None,
            empty=_dummy,
            # TF stops at the first partial step of statically shaped (unbatched) elements, except
            # across workers (input_lib._enable_get_next_as_optional).
            stop_short=ext.input_sharding.num_workers <= 1,
        )
        yield from _emit(self._strategy, ((e, g, None) for e, g in agreed), place)


def _emit(strategy: "Strategy", source: Iterator[tuple[Any, int, int | None]], place: _Placer) -> Iterator[Any]:
    """Yields wrapped per-replica batches, moving each to the device one batch ahead of use.

    ``source`` yields ``(local batch, global batch size, size of the batch this process sliced)``.
    """
    pending = None
    ordinal = 0

    def wrapped(local: Any, global_size: int, sliced: int | None) -> Any:
        # The global batch size travels with the batch (strategy.run reads it), not in a field
        # this generator would overwrite one batch ahead.
        nonlocal ordinal
        ordinal += 1
        batch = strategy._wrap_local(local)  # friend: Strategy's wrapping of local values
        global_batch.tag(batch, global_batch.BatchInfo(global_size, ordinal, sliced))
        stats = getattr(strategy.extended, "stats", None)  # a parameter-server strategy's extended has none
        if stats is not None:
            stats.add_samples(global_size)
        return batch

    for local, global_size, sliced in source:
        placed = place(local)
        if placed is not local:  # moved to the device: the sources of an elastic job's slices follow
            global_batch.follow_sources(local, placed)
        ready = (placed, global_size, sliced)
        if pending is not None:
            yield wrapped(*pending)
        pending = ready
    if pending is not None:
        yield wrapped(*pending)


def _agreed(
    ext: Any,
    elements: Iterator[Any],
    *,
    template: Callable[[], Any] | None = None,
    empty: Callable[[Any], Any] = _cut_batch,
    stop_short: bool = False,
) -> Iterator[tuple[Any, int]]:
    """Yields ``(local batch, global batch size)`` until *every* process's input is exhausted.

    A process that ran out feeds ``empty(its last element)`` (by default the batch cut to zero
    rows), so every replica keeps taking part in the step's collectives and all stop at the same
    step.

    Args:
        ext: the strategy's extended (its collectives).
        elements: this process's elements.
        template: gives an element to shape the stand-in of a process that had none of its own yet
            (None: such a process is an error).
        empty: makes the stand-in from an element.
        stop_short: end at the first step where some process has no element while another has
            one without a batch dimension (TF's rule for statically shaped elements).
    """
    from phalanx.values import ReduceOp

    last = None
    for_ever = iter(elements)
    while True:
        element = next(for_ever, None)
        local_size, unbatched = _examples_in(element) if element is not None else (0, False)
        # One small collective per step: does anyone still have data, how many examples make up
        # this step's global batch, and are elements unbatched?
        flags = ext.all_reduce(
            [torch.tensor([float(element is not None), float(local_size), float(unbatched)], dtype=torch.float64)],
            ReduceOp.SUM,
        )[0]
        if flags[0] == 0 or (stop_short and flags[2] > 0 and int(flags[0]) < ext.num_processes):
            return
        if element is None:
            shape = last if last is not None else (template() if template is not None else None)
            if shape is None:
                raise ValueError(
                    f"The input of {ext.process_name()} produced no batch at all while "
                    "others did; every input pipeline needs at least one batch."
                )
            element = empty(shape)
        else:
            last = element
        yield element, int(flags[1])
