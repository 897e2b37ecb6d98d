"""Every public exception class of phalanx survives pickling, with its message and its fields.

Ray, multiprocessing, ``concurrent.futures`` and torch's elastic agent carry a worker's exception
to the driver by pickling it. Python unpickles an exception by calling its class with its
``args``; an error whose constructor takes more than its message (``ClusterSpecError(key,
value, problem)``) then failed to unpickle (``TypeError: ClusterSpecError.__init__() missing 2
required positional arguments``), and Ray reported that ``TypeError`` instead of the user's error.

The classes are found by reading the source (every ``class`` whose name does not start with
``_``), so a new error class fails here until it has an example in ``EXAMPLES``.
"""

from __future__ import annotations

import ast
import errno
import importlib
import pickle
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from phalanx.values import ReduceOp

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "phalanx"


# One example of each class: ``module.Class -> (args, kwargs)``.
EXAMPLES: dict[str, tuple[tuple, dict]] = {
    # phalanx.errors
    "phalanx.errors.PhalanxError": (("something failed",), {"hint": "do this"}),
    "phalanx.errors.ConfigurationError": (("bad setting",), {"hint": "fix it"}),
    "phalanx.errors.InvalidDeviceError": (("tpu:9",), {"hint": "use cpu"}),
    "phalanx.errors.DeviceNotFoundError": (("/gpu:7",), {"available": 2}),
    "phalanx.errors.DuplicateDeviceError": (("cpu:0", ["cpu:0", "cpu:0"]), {"first": "cpu:0"}),
    "phalanx.errors.ReduceOpError": (("PRODUCT",), {}),
    "phalanx.errors.StrategyScopeError": (("nested scopes",), {}),
    "phalanx.errors.ContextError": (("wrong context",), {}),
    "phalanx.errors.NonDistributedValueError": ((3.0, ReduceOp.SUM, 2), {}),
    "phalanx.errors.GatherShapeError": (([(2, 3), (2, 4)], 0), {"reason": "sizes differ"}),
    "phalanx.errors.RunStructureMismatchError": ((["a tuple", "a dict"],), {"step": 3}),
    "phalanx.errors.NotCallableError": ((42,), {"what": "fn"}),
    "phalanx.errors.ClusterSpecError": (("MASTER_PORT", "47075", "is taken"), {"hint": "another port"}),
    "phalanx.errors.ClusterSpecMismatchError": (("world_size", 2, 3, "worker:1"), {}),
    "phalanx.errors.DistributedRuntimeError": (("lost",), {}),
    "phalanx.errors.RendezvousTimeoutError": ((["worker:1 (rank 1)"], 12.5), {"cause": "nothing answered"}),
    "phalanx.errors.PeerUnavailableError": (
        (["replica:1 (rank 1)"],),
        {"step": 7, "operation": "all-reduce on replica:0 (rank 0)", "cause": "connection reset"},
    ),
    "phalanx.errors.CollectiveTimeoutError": (
        (["replica:1 (rank 1)"],),
        {"step": 7, "operation": "all-reduce on replica:0 (rank 0)", "cause": "timed out after 5 s"},
    ),
    "phalanx.errors.GroupChangedError": (
        (["replica:2 (rank 2)"],),
        {"step": 30, "before": 3, "after": 2, "operation": "all-reduce"},
    ),
    "phalanx.errors.ElasticRecoveryError": (
        ("1 replica(s) remain, fewer than the job's minimum of 2", ["replica:0 (rank 0)"]),
        {},
    ),
    "phalanx.errors.KerasIntegrationError": (("a Dense layer",), {}),
    "phalanx.errors.UnsupportedLayerError": (("lstm",), {"reason": "stateful RNNs are not supported", "hint": "h"}),
    "phalanx.errors.ShardingError": (("layer.weight",), {"reason": "cannot shard it", "hint": "build it"}),
    "phalanx.errors.SparseGradientError": (("emb.weight", "CentralStorageStrategy"), {"hint": "use Mirrored"}),
    "phalanx.errors.LaunchError": (("could not start",), {}),
    "phalanx.errors.ReplicaFailedError": (("replica:1", "replica:1 exited with 1\nTraceback ..."), {}),
    "phalanx.errors.InputMismatchError": (("different batches",), {}),
    "phalanx.errors.WriteError": (("write failed",), {}),
    "phalanx.errors.DiskFullError": (
        ("/ckpt/ckpt-3", "/ckpt"),
        {"free": 0, "error": OSError(errno.ENOSPC, "No space left on device")},
    ),
    "phalanx.errors.CollectiveMismatchError": (
        (
            "shm all_reduce",
            0,
            [
                {"numel": 4, "dtype": "float32", "op": "sum", "tag": 1},
                {"numel": 5, "dtype": "float32", "op": "sum", "tag": 2},
            ],
        ),
        {},
    ),
    "phalanx.errors.ReplicaDivergenceError": (
        ("step", ("replica:0 (rank 0)", "replica:1 (rank 1)"), (3, 4)),
        {"step": 3, "parameter": "fc.weight"},
    ),
    "phalanx.errors.UnsynchronizedParameterError": (("fc.weight", "replica:1 (rank 1)", 2), {"updated_by": "SGD"}),
    "phalanx.errors.SummaryError": (("no step",), {}),
    "phalanx.errors.UnknownTrackerError": (("tensorbord", ("tensorboard", "csv")), {}),
    "phalanx.errors.TrackerUnavailableError": (("mlflow", "mlflow", "mlflow"), {}),
    "phalanx.errors.TrackerError": (("mlflow", RuntimeError("no server")), {"hint": "start one"}),
    "phalanx.errors.TrackerFailedWarning": (("the csv tracker failed",), {}),
    "phalanx.errors.NonFiniteSummaryWarning": (("loss is nan",), {}),
    "phalanx.errors.ProgressError": (("unknown style",), {}),
    "phalanx.errors.ProfileError": (("steps (3, 1)",), {}),
    # phalanx.ps.errors
    "phalanx.ps.errors.TaskUnavailableError": ((1, "10.0.0.2:2222", "refused"), {"hint": "restart it"}),
    "phalanx.ps.errors.ParameterServerUnavailableError": ((1, "127.0.0.1:2222", "connection refused"), {}),
    "phalanx.ps.errors.WorkerUnavailableError": ((0, "127.0.0.1:2223", "timed out"), {}),
    "phalanx.ps.errors.CancelledError": (("cancelled",), {}),
    "phalanx.ps.errors.RemoteError": (("worker:0", "KeyError", "'x'", "Traceback ...\nKeyError: 'x'"), {}),
    "phalanx.ps.errors.ClusterSecretError": (("<unset>", "is not set"), {}),
    "phalanx.ps.errors.AuthenticationError": (("bad signature",), {}),
    "phalanx.ps.errors.OverloadedError": (("too many requests",), {}),
    "phalanx.ps.errors.OrphanedError": (("ps:0", 300.0, True), {}),
    "phalanx.ps.errors.ProtocolError": (("bad frame",), {}),
    "phalanx.ps.errors.VariableError": (("unknown variable 'w'",), {}),
    "phalanx.ps.errors.CoordinatorClosedError": (("closed",), {}),
    "phalanx.ps.tls.TlsConfigError": (("PHALANX_TLS_CERT", "/no/cert.pem", "cannot be read"), {}),
    "phalanx.ps.transport.ServiceError": (("not_found", "no such variable"), {}),
    "phalanx.ps.transport.TransportError": (("unavailable", "connection refused"), {}),
    "phalanx.ps.worker.MissingResourceError": (("dataset 3",), {}),
    # phalanx.checkpoint.errors
    "phalanx.checkpoint.errors.CheckpointError": (("cannot save",), {}),
    "phalanx.checkpoint.errors.CheckpointNotFoundError": (("/ckpt/ckpt-3",), {"hint": "save first"}),
    "phalanx.checkpoint.errors.CorruptCheckpointError": (("/ckpt/ckpt-3/a.safetensors", "checksum differs"), {}),
    "phalanx.checkpoint.errors.UnsafeCheckpointError": (("/ckpt/x.pt", "a pickled object"), {}),
    "phalanx.checkpoint.errors.CheckpointMismatchError": (("model", "shape differs"), {"hint": "same model"}),
    "phalanx.checkpoint.errors.UnsupportedStateError": (("opt/extra", {1, 2}), {}),
    # elsewhere
    "phalanx.input.element_spec.EmptyOptionalError": (("no value",), {}),
    "phalanx.input.distributed_dataset.UnbatchedElementError": ((3,), {}),
    "phalanx.input.distributed_dataset.SmallBatchWarning": (("batch of 1 for 2 replicas",), {}),
    "phalanx.interactive.session.ReplicaCellError": ((1, "failed", "Traceback ...\nValueError: x"), {}),
    "phalanx.core.compiled.CompileFallbackWarning": (("ran eagerly",), {}),
    "phalanx.core.compiled.CompileOptionsError": (({"mode": "fastest"}, "unknown mode"), {}),
    "phalanx.core.distributed_variable.AggregationError": (("cannot assign",), {"variable": "v", "hint": "h"}),
    "phalanx.core.losses.LossScaleWarning": (("unscaled loss",), {}),
    "phalanx.core.hazards.ProcessHazardWarning": (("random.seed() in every replica",), {}),
    "phalanx.launch.job_end.Interrupted": ((15,), {}),
    "phalanx.keras.metrics.UnsupportedMetricError": (("a metric in a scheduled function",), {}),
    "phalanx.keras._version.UnsupportedKerasError": (("keras 2.15",), {"hint": "install Keras 3"}),
    "phalanx.keras.parameter_server.UnsupportedOptimizerError": (("Lion",), {}),
}


def _exception_classes() -> list[str]:
    """``module.Class`` of every class with a public name in phalanx's source that is an exception."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        tree = ast.parse(path.read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_") and n.bases]
        if not names:
            continue
        candidates = [n for n in names if n.endswith(("Error", "Warning", "Exception")) or n == "Interrupted"]
        if not candidates:
            continue
        mod = importlib.import_module(module)
        found += [
            f"{module}.{n}"
            for n in candidates
            if isinstance(getattr(mod, n), type) and issubclass(getattr(mod, n), BaseException)
        ]
    return found


def _make(qualified: str) -> BaseException:
    module, name = qualified.rsplit(".", 1)
    args, kwargs = EXAMPLES[qualified]
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


def _fields(e: BaseException) -> dict:
    return {k: v for k, v in vars(e).items() if not k.startswith("__")}


def _same(a, b) -> bool:
    if isinstance(a, BaseException):  # a wrapped cause: same type and text
        return type(a) is type(b) and str(a) == str(b)
    return a == b


# Read (and imported) at collection: importing Keras and torch sets variables the hygiene check would see.
CLASSES = _exception_classes()


def test_every_public_error_class_has_an_example():
    classes = CLASSES
    assert len(classes) > 60, classes  # the source scan found them
    missing = sorted(set(classes) - set(EXAMPLES))
    assert not missing, f"give these error classes an example in EXAMPLES (test_error_pickling.py): {missing}"


@pytest.mark.parametrize("qualified", sorted(EXAMPLES))
def test_round_trip_keeps_type_message_and_fields(qualified):
    error = _make(qualified)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert back.args == error.args
    fields, restored = _fields(error), _fields(back)
    assert fields.keys() == restored.keys(), (fields, restored)
    for key, value in fields.items():
        assert _same(value, restored[key]), (key, value, restored[key])
    if isinstance(error, OSError):  # errno / strerror / filename are OSError's own slots
        assert (back.errno, back.strerror, back.filename) == (error.errno, error.strerror, error.filename)


def test_peer_unavailable_keeps_its_diagnosis():
    """A field set after construction (the job's diagnosis) travels too, not only the arguments."""
    from phalanx.errors import PeerUnavailableError

    error = PeerUnavailableError(["replica:1 (rank 1)"], step=3, operation="all-reduce", cause="reset")
    error.diagnosis = {"cause": "replica:1 died", "replicas": {"1": {"state": "dead"}}}
    back = pickle.loads(pickle.dumps(error))
    assert back.diagnosis == error.diagnosis and back.step == 3


def _raise_cluster_spec_error() -> None:
    from phalanx.errors import ClusterSpecError

    raise ClusterSpecError("MASTER_PORT", "47075", "port 47075 is taken by another program", hint="another port")


def test_an_error_raised_in_a_worker_process_reaches_the_caller_as_itself():
    """The user's path: concurrent.futures pickles the worker's exception back to the caller."""
    from phalanx.errors import ClusterSpecError

    with ProcessPoolExecutor(max_workers=1) as pool:
        future = pool.submit(_raise_cluster_spec_error)
        with pytest.raises(ClusterSpecError) as caught:
            future.result(timeout=120)
    assert (caught.value.key, caught.value.value) == ("MASTER_PORT", "47075")
    assert "port 47075 is taken" in str(caught.value) and caught.value.hint == "another port"
