"""Typed errors raised by phalanx.

Every error carries the value it received and a hint, so a user can fix the input
without reading phalanx's source. Errors that come from another process name the
task (``worker:1``), the global rank and, where known, the step.

Example:
    >>> from phalanx.errors import InvalidDeviceError
    >>> try:
    ...     raise InvalidDeviceError("tpu:9", hint="use 'cpu', 'cuda:0' or '/gpu:0'")
    ... except ValueError as e:
    ...     print(e)
    Unknown device 'tpu:9'. HINT: use 'cpu', 'cuda:0' or '/gpu:0'
"""

from __future__ import annotations

import inspect
from typing import Any

from phalanx import _tracebacks


def user_stacklevel() -> int:
    """The ``stacklevel`` of a ``warnings.warn`` that names the user's line: the first frame, from
    the function that warns upwards, that is neither phalanx's nor contextlib's. However deep the
    call sits (``Strategy.run``, ``extended.call_for_each_replica``, the first step's watch), the
    warning points where the user called phalanx."""
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # the function that warns: stacklevel 1
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("phalanx", "contextlib"):
        frame, level = frame.f_back, level + 1
    return level


class FieldsPickled:
    """Mixin of an exception that is pickled with its message and every field.

    Python unpickles an exception by calling its class with its ``args``, the message alone here:
    a constructor that takes fields (``ClusterSpecError(key, value, problem)``) then fails, and the
    receiver (Ray's driver, a ``concurrent.futures`` caller) sees a ``TypeError`` instead of the
    error. An exception with this mixin is rebuilt without its constructor instead, from its
    message and its fields, those set after construction included (a diagnosis).
    """

    def __reduce__(self) -> tuple:
        return (_unpickle, (type(self), self.args), exception_state(self))  # type: ignore[attr-defined]


class PhalanxError(FieldsPickled, Exception):
    """Base class of every error raised by phalanx.

    Every phalanx error survives pickling (Ray, multiprocessing, ``concurrent.futures`` and torch's
    elastic agent carry a worker's exception to the caller that way) with its message and its
    fields: see :class:`FieldsPickled`.
    """

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.hint = hint
        super().__init__(f"{message} HINT: {hint}" if hint else message)


def exception_state(error: BaseException) -> dict[str, Any]:
    """What pickling ``error`` carries besides its args: its fields, and an ``OSError``'s own.

    Example:
        >>> import pickle
        >>> e = pickle.loads(pickle.dumps(ClusterSpecError("MASTER_PORT", "47075", "is taken")))
        >>> e.key, e.value, str(e)
        ('MASTER_PORT', '47075', "Invalid cluster configuration: MASTER_PORT='47075': is taken.")
    """
    state = dict(vars(error))
    if isinstance(error, OSError):  # slots of OSError, not in __dict__; one left unset stays unset (str reads it)
        own = {"errno": error.errno, "strerror": error.strerror, "filename": error.filename}
        state.update({k: v for k, v in own.items() if v is not None})
    return state


def _unpickle(cls: type[BaseException], args: tuple) -> BaseException:
    """An exception of ``cls`` with ``args``, its constructor not called (its fields follow as state)."""
    # The builtin base whose memory layout the class has: OSError's (a DiskFullError) or the plain one.
    # Its __init__ sets args (OSError's __new__ leaves them to __init__ in a class with its own).
    base: Any = OSError if issubclass(cls, OSError) else BaseException
    error = base.__new__(cls, *args)
    base.__init__(error, *args)
    return error


class ConfigurationError(PhalanxError):
    """Base of the errors in what the program was started with: a cluster description (TF_CONFIG,
    torchrun's or Slurm's variables), a ``PHALANX_*`` setting, a device name.

    Uncaught, one reads as the program's own frames and its line, without phalanx's frames
    (``PHALANX_DEBUG=1`` shows them; :mod:`phalanx._tracebacks`).
    """

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        _tracebacks.install(ConfigurationError)
        super().__init__(message, hint=hint)


# --------------------------------------------------------------------------- input errors
class InvalidDeviceError(ConfigurationError, ValueError):
    """A device string that phalanx cannot parse or that this host does not have."""

    def __init__(self, device: Any, *, hint: str | None = None) -> None:
        self.device = device
        super().__init__(f"Unknown device {device!r}.", hint=hint)


class DeviceNotFoundError(InvalidDeviceError):
    """A well-formed device name for a device this host does not have (e.g. ``'/gpu:7'`` on 2 GPUs)."""

    def __init__(self, device: Any, *, available: int, hint: str | None = None) -> None:
        self.available = available
        what = f"{available} visible GPU(s)" if available else "no visible GPU"
        ConfigurationError.__init__(self, f"Device {device!r} is not present: this host has {what}.", hint=hint)
        self.device = device


class DuplicateDeviceError(InvalidDeviceError):
    """A device named twice in a strategy's device list (``['cpu:0', 'cpu:0']``): known, but repeated.

    Attributes:
        device: the repeated device, as written at its second appearance.
        devices: the whole list, as given.
    """

    def __init__(self, device: Any, devices: list[Any], *, first: Any = None, what: str = "devices") -> None:
        self.devices = devices
        same = f" (the same as {first!r})" if first is not None and first != device else ""
        ConfigurationError.__init__(
            self,
            f"Duplicate device {device!r}{same} in {what} {devices!r}.",
            hint=f"each device may appear once in {what}",
        )
        self.device = device


class ReduceOpError(PhalanxError, ValueError):
    """An unknown reduction operation."""

    def __init__(self, op: Any) -> None:
        self.op = op
        super().__init__(
            f"Unknown reduce op {op!r}.",
            hint="use phalanx.ReduceOp.SUM or phalanx.ReduceOp.MEAN (or the strings 'SUM' / 'MEAN')",
        )


class StrategyScopeError(PhalanxError, RuntimeError):
    """Scopes of two different strategies were nested, or a scope was used wrongly."""


class ContextError(PhalanxError, RuntimeError):
    """An API was called in the wrong context (replica vs cross-replica)."""


class NonDistributedValueError(PhalanxError, ValueError):
    """A value that is not distributed (a plain tensor) was SUM-reduced across the replicas of one worker.

    TF refuses it too (``reduce_non_distributed_value``): a plain tensor is one value per worker,
    and summing the same value once per replica is not a defined reduction. MEAN returns the value.

    Attributes:
        value: the value received.
        num_replicas: the replicas it would have been summed over.
    """

    def __init__(self, value: Any, reduce_op: Any, num_replicas: int) -> None:
        self.value, self.num_replicas = value, num_replicas
        shown = repr(value)
        super().__init__(
            f"A value that is not distributed ({shown[:120]}{'...' if len(shown) > 120 else ''}) cannot be "
            f"{reduce_op.name}-reduced across the {num_replicas} replicas of one worker.",
            hint="reduce the PerReplica value returned by strategy.run, or use ReduceOp.MEAN for a value every "
            "replica holds",
        )


class GatherShapeError(PhalanxError, ValueError):
    """The replicas' tensors cannot be concatenated: their ranks, or their sizes off the gather
    axis, differ (TF raises too). Raised on every replica at the same call.

    Attributes:
        shapes: every replica's shape, in replica order.
        axis: the gather axis.
    """

    def __init__(self, shapes: list[tuple[int, ...]], axis: int | None, *, reason: str) -> None:
        self.shapes, self.axis = shapes, axis
        shown = ", ".join(f"replica {i}: {tuple(s)}" for i, s in enumerate(shapes))
        super().__init__(
            f"Cannot gather along axis {axis}: {reason} ({shown}).",
            hint="the replicas' tensors must have the same rank and the same sizes in every dimension but the "
            "gather axis",
        )


class RunStructureMismatchError(PhalanxError, ValueError):
    """The replicas' functions given to ``strategy.run`` returned different structures.

    TF refuses to regroup them (a ``ValueError``); here each replica is a process, so the check
    happens at the first collective that reads the result (``reduce``, ``gather``,
    ``experimental_local_results``), on every replica at once, before any data is mixed up.

    Attributes:
        structures: each replica's structure, described, in replica order.
    """

    def __init__(self, structures: list[str], step: int | None = None) -> None:
        self.structures = structures
        at = f" at step {step}" if step is not None else ""
        shown = "; ".join(f"replica {i}: {s}" for i, s in enumerate(structures))
        super().__init__(
            f"The replicas returned different structures from strategy.run{at} ({shown}).",
            hint="return the same nested structure (same keys, lengths and None positions) on every replica; "
            "a replica with nothing to return can return zeros of the same shape",
        )


class NotCallableError(PhalanxError, TypeError):
    """``strategy.run`` (or a similar API) was given something that is not callable."""

    def __init__(self, value: Any, *, what: str = "fn") -> None:
        self.value = value
        super().__init__(
            f"`{what}` must be callable; received {value!r} (of type {type(value).__name__}).",
            hint="pass the function itself, e.g. strategy.run(train_step, args=(batch,))",
        )


# --------------------------------------------------------------------------- cluster errors
class ClusterSpecError(ConfigurationError, ValueError):
    """A malformed cluster description (TF_CONFIG, torchrun or Slurm environment).

    Attributes:
        key: the key (or environment variable) that is wrong, e.g. ``"task.index"``.
        value: the value received for it.
    """

    def __init__(self, key: str, value: Any, problem: str, *, hint: str | None = None) -> None:
        self.key = key
        self.value = value
        super().__init__(f"Invalid cluster configuration: {key}={value!r}: {problem}.", hint=hint)


class ClusterSpecMismatchError(PhalanxError, RuntimeError):
    """Tasks of one job were started with cluster descriptions that disagree."""

    def __init__(self, field: str, mine: Any, theirs: Any, other_task: str) -> None:
        self.field = field
        self.mine = mine
        self.theirs = theirs
        self.other_task = other_task
        super().__init__(
            f"Cluster spec mismatch in field {field!r}: this task has {mine!r}, {other_task} has {theirs!r}.",
            hint="start every task with the same cluster (TF_CONFIG 'cluster' / WORLD_SIZE / "
            "MASTER_ADDR); only the 'task' part may differ",
        )


# --------------------------------------------------------------------------- runtime errors
class DistributedRuntimeError(PhalanxError, RuntimeError):
    """Base of errors raised while processes of a job talk to each other."""


class RendezvousTimeoutError(DistributedRuntimeError):
    """Not every task joined the job within the rendezvous timeout."""

    #: how many missing tasks the message names; the rest are counted (a job of thousands stays readable)
    NAMED = 8

    def __init__(self, missing: list[str], timeout: float, *, cause: str | None = None) -> None:
        self.missing = missing
        self.timeout = timeout
        self.cause = cause
        named = ", ".join(missing[: self.NAMED]) or "?"
        if len(missing) > self.NAMED:
            named += f" and {len(missing) - self.NAMED} more ({len(missing)} tasks missing)"
        super().__init__(
            f"Timed out after {timeout:.1f}s waiting for tasks: {named}" + (f": {cause}." if cause else "."),
            hint="check that every task was started and can reach the chief's address",
        )


class PeerUnavailableError(DistributedRuntimeError):
    """A peer process died or stopped responding during a collective.

    Attributes:
        peers: the peers named (``"replica:1 (rank 1)"``), those the collective waited for.
        step: the step, where known.
        operation: the collective and the replica that raised (``"all-reduce on replica:0 (rank 0)"``).
        cause: what happened to them (with a diagnosis: where each one is).
        diagnosis: the job's diagnosis (:mod:`phalanx.comm.diagnosis`) when the replica that raised
            could ask its peers where they are, else None.
    """

    def __init__(
        self, peers: list[str], *, step: int | None, operation: str, cause: str, hint: str | None = None
    ) -> None:
        self.peers = peers
        self.step = step
        self.operation = operation
        self.cause = cause
        self.diagnosis: dict[str, Any] | None = None
        where = f" at step {step}" if step is not None else ""
        who = ", ".join(peers) if peers else "an unidentified peer"
        super().__init__(
            f"{operation} failed{where}: {who} is unavailable ({cause}).",
            hint=hint
            or "synchronous training cannot continue without every replica; restart the job "
            "(phalanx run --max-restarts K) and resume from the last checkpoint",
        )


class CollectiveTimeoutError(PeerUnavailableError):
    """A collective did not complete within its timeout (a stalled peer)."""


class GroupChangedError(PeerUnavailableError):
    """An elastic job's group changed during a step: every survivor abandoned the step's update.

    ``strategy.run`` catches it and runs the step again on the re-formed group, each replica
    taking its new share of the same global batch; a program sees it only where its step ran
    outside ``strategy.run``.

    Attributes:
        lost: the replicas that left (their names in the job, ``"replica 2"``).
        before, after: the number of replicas before and after.
    """

    def __init__(self, lost: list[str], *, step: int | None, before: int, after: int, operation: str) -> None:
        self.lost, self.before, self.after = lost, before, after
        super().__init__(
            lost,
            step=step,
            operation=operation,
            cause=f"the group re-formed with {after} of its {before} replicas; the step is run again",
            hint="run the step inside strategy.run, which runs it again on the re-formed group",
        )


class ElasticRecoveryError(DistributedRuntimeError):
    """An elastic job could not re-form its group after losing replicas.

    Attributes:
        reason: why (fewer survivors than the job's minimum, replicas at different points of the
            step, this replica left out of the group).
        survivors: the replicas that were still there.
    """

    def __init__(self, reason: str, survivors: list[str], *, hint: str | None = None) -> None:
        self.reason, self.survivors = reason, survivors
        super().__init__(
            f"The job could not re-form its group: {reason} (survivors: {', '.join(survivors) or 'none'}).",
            hint=hint or "restart the job (phalanx run --max-restarts K) and resume from the last checkpoint",
        )


class KerasIntegrationError(PhalanxError, RuntimeError):
    """A Keras model was built in a strategy's scope, but ``phalanx.keras`` could not join.

    The scope joins the integration itself when Keras is loaded (:mod:`phalanx.core.integrations`);
    this error remains for a Keras it could not join. Without the integration, ``fit`` would run
    undistributed on every replica (each on the whole global batch, the summed gradients scaling
    the update by the replica count): silently wrong training, which this error prevents.
    """

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        super().__init__(
            f"A Keras layer ({type(layer).__name__}) was built in a strategy's scope, but phalanx.keras is not "
            f"imported, so Keras would train it undistributed.",
            hint="add `import phalanx.keras` once, after `import keras` and before building the model",
        )


class UnsupportedLayerError(PhalanxError, ValueError):
    """A layer that cannot be distributed by the strategy whose scope built or adapted its model.

    Raised where TF raises for the same layer (a stateful RNN under a strategy with more than one
    replica: ``ValueError: Stateful RNNs ... are not yet supported with tf.distribute.Strategy``).
    """

    def __init__(self, layer: Any, reason: str, *, hint: str | None = None) -> None:
        self.layer = layer
        super().__init__(f"{reason} (layer {getattr(layer, 'name', type(layer).__name__)!r})", hint=hint)


class ShardingError(PhalanxError, ValueError):
    """FullyShardedStrategy cannot shard what it was given.

    Attributes:
        value: the value refused (a parameter's label, a module's class, an argument).
    """

    def __init__(self, value: Any, reason: str, *, hint: str | None = None) -> None:
        self.value = value
        super().__init__(f"{reason} (received {value!r}).", hint=hint)


class SparseGradientError(PhalanxError, RuntimeError):
    """A parameter got a sparse gradient where the strategy cannot sum sparse gradients."""

    def __init__(self, parameter: str, where: str, *, hint: str | None = None) -> None:
        self.parameter, self.where = parameter, where
        super().__init__(f"{parameter} has a sparse gradient, which {where} cannot sum", hint=hint)


class LaunchError(PhalanxError, RuntimeError):
    """A replica process could not be started or exited with an error."""


class ReplicaFailedError(LaunchError):
    """A replica this process started failed; raised where the program ends its replicas explicitly.

    Where the host program runs no Python exit handlers (R through reticulate), replica 0 learns a
    replica's failure when it closes its last strategy, and raises this there.
    """

    def __init__(self, replica: str, report: str) -> None:
        self.replica = replica
        self.report = report
        super().__init__(
            report.strip(), hint="the replica's log (named above) holds its whole output; fix its error and run again"
        )


class InputMismatchError(PhalanxError, RuntimeError):
    """Replicas that must read the same global batches were fed different ones."""


class WriteError(DistributedRuntimeError):
    """The chief failed to write a file every replica waits for (``model.save`` under a strategy)."""


class DiskFullError(WriteError, OSError):
    """A write ran out of space (``ENOSPC``, or ``EDQUOT``: a quota) in the middle of a save.

    An ``OSError`` with the ``errno`` the system gave, so ``except OSError`` and checks of
    ``e.errno`` work as they do for a bare one; the message names what was being saved, where,
    and how much space the file system had left.

    Attributes:
        path: what was being written (a checkpoint's directory, a file).
        directory: the directory it goes to.
        free: bytes free there when the error was raised, or None when unknown.
    """

    def __init__(
        self, path: str, directory: str, *, free: int | None, error: OSError, what: str = "checkpoint"
    ) -> None:
        self.path, self.directory, self.free = path, directory, free
        left = f"{free} bytes free" if free is not None else "free space unknown"
        reason = error.strerror or str(error)
        PhalanxError.__init__(
            self,
            f"Cannot write the {what} {path!r}: {reason} in {directory!r} ({left}). Nothing was "
            f"committed: the earlier {what}s there are intact.",
            hint=f"free space on that file system (older {what}s: CheckpointManager(max_to_keep=...)), "
            "or save to a directory with room",
        )
        # OSError's fields, for callers that test them (set after the message: OSError's
        # constructor would otherwise read the message as (errno, strerror)).
        self.errno, self.strerror, self.filename = error.errno, error.strerror, path

    def __str__(self) -> str:  # OSError's own would print "[Errno 28] ..." without the message
        return str(self.args[0])


class CollectiveMismatchError(DistributedRuntimeError):
    """The ranks met in one collective with calls that do not match (tensor size, dtype or op).

    Raised on every rank at the same call. Each call carries a *tag*, an integer its caller
    attached (phalanx's communicator passes the step), so the error says what each rank was doing:
    ranks at different tags are out of step, not merely passing different tensors.

    Attributes:
        operation: the collective, e.g. ``"shm all_reduce"``.
        rank: the rank that raised (an index among the ranks of the collective).
        calls: every rank's call in rank order, as ``{"numel", "dtype", "op", "tag"}`` (``tag``
            None where the caller attached none).
    """

    def __init__(self, operation: str, rank: int, calls: list[dict[str, Any]]) -> None:
        self.operation, self.rank, self.calls = operation, rank, calls
        mine = calls[rank]
        shown = "; ".join(
            f"rank {j}: numel={c['numel']} {c['dtype']} {c['op']}"
            + (f" tag={c['tag']}" if c["tag"] is not None else "")
            for j, c in enumerate(calls)
        )
        bad = [
            j
            for j, c in enumerate(calls)
            if (c["numel"], c["dtype"], c["op"]) != (mine["numel"], mine["dtype"], mine["op"])
        ]
        super().__init__(
            f"{operation}: ranks {bad} passed a different numel/dtype/op than rank {rank} ({shown}).",
            hint="call the collective with the same tensor shape, dtype and op, in the same order, on every rank",
        )

    @property
    def tags(self) -> list[int | None]:
        """Every rank's tag, in rank order."""
        return [c["tag"] for c in self.calls]


class ReplicaDivergenceError(DistributedRuntimeError):
    """Replicas that must agree do not: a different step, global batch size, batch or parameters.

    Raised by the consistency guard that rides on every gradient all-reduce, on every replica at
    once (each sees every replica's values), within the step where the disagreement appears.

    Attributes:
        field: what differs: ``"step"``, ``"global batch size"``, ``"batch"``, ``"parameters"``
            or ``"unsynchronised parameters"``.
        replicas: the two replicas compared (names such as ``"replica:1 (rank 1)"``).
        values: their two values, in the order of ``replicas``.
        parameter: the first parameter that differs, where known.
    """

    def __init__(
        self,
        field: str,
        replicas: tuple[str, str],
        values: tuple[Any, Any],
        *,
        step: int | None = None,
        parameter: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.field, self.replicas, self.values = field, replicas, values
        self.step, self.parameter = step, parameter
        where = f" at step {step}" if step is not None else ""
        which = f"; first differing parameter: {parameter}" if parameter else ""
        super().__init__(
            f"Replicas diverged{where}: {field} is {values[0]!r} on {replicas[0]} but {values[1]!r} on "
            f"{replicas[1]}{which}.",
            hint=hint or _DIVERGENCE_HINTS.get(field, "every replica must run the same steps on the same data"),
        )


_DIVERGENCE_HINTS = {
    "step": "a replica skipped or repeated a step (an exception caught on one replica only, or a data-dependent "
    "`continue`); every replica must call strategy.run and backward() the same number of times",
    "global batch size": "every process must feed global batches of the same size (the same batch_size in each "
    "process's loader); use distribute_datasets_from_function for per-process pipelines",
    "batch": "a replica consumed a different number of batches from its distributed dataset; catch errors around "
    "whole steps on every replica alike, or not at all",
    "parameters": "the replicas' parameters differ: create the model and optimizer inside strategy.scope(), and "
    "restore checkpoints on every replica",
    "unsynchronised parameters": "create the model (and its optimizer) inside `with strategy.scope():`; only "
    "parameters created in it are synchronised (their initial values broadcast from replica 0, their gradients "
    "summed). A seed can make the initial values equal everywhere, never the gradients. A parameter that belongs to no "
    "module is not seen by the scope either: make it a phalanx.Variable (TF's tf.Variable) or an attribute of a "
    "module, or pass it to strategy.extended.adopt_variables(...) on every replica",
}


class UnsynchronizedParameterError(ReplicaDivergenceError):
    """A trainable parameter used inside ``strategy.run`` was never synchronised across replicas."""

    def __init__(self, parameter: str, replica: str, step: int | None, *, updated_by: str | None = None) -> None:
        self.field, self.replicas, self.values = "unsynchronised parameters", (replica, "its peers"), (parameter, None)
        self.step, self.parameter = step, parameter
        if updated_by is None:
            what = "is used in strategy.run"
            why = (
                "was created outside strategy.scope(), so it is not synchronised (whether or not a seed made its "
                "initial values equal on every replica)"
            )
        else:  # found by the optimizer check: no module holds it, so where it was created is unknown
            what = f"is updated by {updated_by} in strategy.run"
            why = "no scope captured it (created outside strategy.scope(), or in it but in no module)"
        DistributedRuntimeError.__init__(
            self,
            f"Parameter {parameter} {what} on {replica} (step {step}) but {why}; its gradients are never summed, "
            "so the replicas would train different models.",
            hint=_DIVERGENCE_HINTS["unsynchronised parameters"],
        )


# --------------------------------------------------------------------------- watching a run
class SummaryError(PhalanxError, ValueError):
    """A summary call phalanx cannot honour (no step, a per-replica value, a step that goes back)."""


class UnknownTrackerError(SummaryError):
    """A tracker name phalanx does not know (``create_file_writer(trackers=("tensorbord",))``).

    Attributes:
        name: the name received.
        known: the names phalanx knows.
    """

    def __init__(self, name: Any, known: tuple[str, ...]) -> None:
        self.name, self.known = name, known
        super().__init__(
            f"Unknown tracker {name!r}.",
            hint=f"use one of {', '.join(map(repr, known))}, or pass a phalanx.trackers.Tracker object",
        )


class TrackerUnavailableError(SummaryError, ImportError):
    """A tracker whose official client is not installed; the hint names the extra that installs it.

    Attributes:
        tracker: the tracker's name (``"mlflow"``).
        module: the client's module that could not be found.
        extra: the ``phalanx[...]`` extra that installs it.
    """

    def __init__(self, tracker: str, module: str, extra: str) -> None:
        self.tracker, self.module, self.extra = tracker, module, extra
        super().__init__(
            f"The {tracker!r} tracker needs the {module!r} package, which is not installed.",
            hint=f'pip install -e ".[{extra}]"',
        )


class TrackerError(SummaryError, RuntimeError):
    """A tracker could not start its run (a tracking server or a login it needs is missing).

    Attributes:
        tracker: the tracker's name.
    """

    def __init__(self, tracker: str, cause: BaseException, *, hint: str | None = None) -> None:
        self.tracker = tracker
        super().__init__(f"The {tracker!r} tracker could not start its run: {cause}", hint=hint)


class TrackerFailedWarning(UserWarning):
    """A tracker failed in the middle of a run; the run goes on with the others, which lose nothing."""


class NonFiniteSummaryWarning(UserWarning):
    """A summary value was NaN or infinite; it is logged as it is, and said once per writer."""


class ProgressError(PhalanxError, ValueError):
    """A progress bar phalanx cannot show (an unknown style, its client missing, a per-replica value)."""


class ProfileError(PhalanxError, ValueError):
    """A profile phalanx cannot take (steps that are not a range ``(first, last)`` of positive steps)."""
