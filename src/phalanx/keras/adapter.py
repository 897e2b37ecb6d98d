"""What a Keras model adapted to a strategy is: :class:`DistributedModel`, and the PS adapter.

The base wraps ``fit`` / ``evaluate`` / ``predict`` (the chief keeps the progress bar and the
writing callbacks, a :class:`~phalanx.keras.callbacks.Coordinator` is appended) and makes
``save`` / ``save_weights`` / ``export`` write once; :class:`PsAdapter` is the parameter-server
strategy's, :class:`~phalanx.keras.sync_adapter.SyncAdapter` the synchronous strategies'. See
:mod:`phalanx.keras.model` for the whole adaptation and its semantics.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable

import keras
import torch

from phalanx._compat.keras import current_device as keras_device
from phalanx.errors import WriteError
from phalanx.keras import callbacks as px_callbacks
from phalanx.keras import discovery, sharding
from phalanx.values import ReduceOp

if TYPE_CHECKING:
    from phalanx.core.strategy import Strategy


_KINDS = ("train", "test", "predict")
_WRITERS = ("save", "save_weights", "export")


class DistributedModel:
    """A Keras model's fit / evaluate / predict under a strategy; see the module docstring.

    Created by the scope (or :func:`distribute`) through :func:`adapter_for`, as a
    :class:`SyncAdapter` (synchronous strategies) or a :class:`PsAdapter` (parameter servers);
    reach it with ``distributed_model(model)``.
    """

    def __init__(self, model: Any, strategy: "Strategy") -> None:
        self._model_ref = weakref.ref(model)
        self.strategy = strategy
        self._writing = False  # inside the chief's own save: nested saves are not collective
        discovery.attach(model, self)
        for method in ("fit", "evaluate", "predict"):
            wrapper = functools.update_wrapper(functools.partial(getattr(self, method)), getattr(type(model), method))
            # object.__setattr__: an instance attribute, bypassing Keras' and torch's tracking.
            object.__setattr__(model, method, wrapper)
        for method in _WRITERS:
            if hasattr(type(model), method):
                wrapper = functools.update_wrapper(
                    functools.partial(self._write_once, method), getattr(type(model), method)
                )
                object.__setattr__(model, method, wrapper)
        # Also now, in case the model is adapted by its own first fit() (a model without input
        # shape, fitted inside the scope): that fit then takes phalanx's step functions.
        self._prepare()

    # ------------------------------------------------------------------------------ properties
    @property
    def model(self) -> Any:
        model = self._model_ref()
        if model is None:
            raise ReferenceError("the Keras model was garbage-collected")
        return model

    @property
    def _ext(self) -> Any:
        return self.strategy.extended

    @property
    def _num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def _rank(self) -> int:
        return self._ext.process_index

    @property
    def is_chief(self) -> bool:
        return bool(self._ext.should_checkpoint)

    # ------------------------------------------------------------------------------ public methods
    def fit(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_inference(type(self.model).evaluate, args, kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_inference(type(self.model).predict, args, kwargs)

    def _run_inference(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Adapts Keras' step functions (again after ``compile`` reset them); nothing by default."""

    def _mark_synced(self, params: Any) -> None:
        """Notes parameters the strategy's scope captured (and synchronises); nothing by default."""

    def _write_once(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``model.<method>(path)`` once per path: the chief writes, and a replica that was given a
        path of its own (TF's multi-worker pattern: non-chief workers save to temporary paths) writes
        that one; every replica returns once every file is complete."""
        model = self.model
        original = getattr(type(model), method)
        if self._writing or self._num_replicas == 1 or isinstance(self, PsAdapter) or _in_chief_only_callback():
            return original(model, *args, **kwargs)
        path = str(kwargs.get("filepath", args[0] if args else ""))
        digest = int.from_bytes(hashlib.sha256(path.encode()).digest()[:7], "big")
        chiefs = torch.tensor([digest if self.is_chief else 0], dtype=torch.int64)
        self._ext.broadcast([chiefs])
        result, error = None, None
        # A sharded model's weights are gathered by every replica first (a collective), so the
        # writer reads whole values.
        with sharding.gathered(model):
            if self.is_chief or int(chiefs[0]) != digest:
                self._writing = True
                try:
                    result = original(model, *args, **kwargs)
                except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
                    error = e
                finally:
                    self._writing = False
        # Also the barrier: nobody returns before the files are complete.
        failed = self._ext.all_reduce([torch.tensor([float(error is not None)])], ReduceOp.SUM)[0]
        if error is not None:
            raise error
        if float(failed[0]) > 0:
            raise WriteError(
                f"model.{method}(...) failed on another replica; see its error (the chief's output "
                "or its replica log).",
                hint="the file may be missing or incomplete",
            )
        return result

    @staticmethod
    def _bind(method: Callable[..., Any], model: Any, args: tuple, kwargs: dict) -> tuple[Callable, dict]:
        try:
            bound = inspect.signature(method).bind(model, *args, **kwargs)
        except TypeError:
            # A custom signature phalanx cannot read: pass the call through as given.
            return (lambda _: method(model, *args, **kwargs)), dict(kwargs)
        params = inspect.signature(method).parameters

        def call(arguments: dict) -> Any:
            for name in ("callbacks", "verbose", "x", "validation_data"):
                if name in arguments and name in params:
                    bound.arguments[name] = arguments[name]
            return method(*bound.args, **bound.kwargs)

        return call, dict(bound.arguments)


class PsAdapter(DistributedModel):
    """Under ParameterServerStrategy: the chief schedules ``fit``'s steps on the workers
    (:mod:`phalanx.keras.parameter_server`); ``evaluate`` and ``predict`` run Keras' own steps
    on the chief's copy after pulling the servers' values (TF's inline evaluation)."""

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        from phalanx.keras import parameter_server

        model = self.model
        _, arguments = self._bind(type(model).fit, model, args, kwargs)
        return parameter_server.fit(self, arguments)

    def _run_inference(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        call, arguments = self._bind(method, self.model, args, kwargs)
        self._ext.pull_variables()
        return call(arguments)


def _in_chief_only_callback(depth: int = 12) -> bool:
    """Whether a writer callback that runs on the chief alone (ModelCheckpoint, ...) is calling.

    Such a callback saves on the chief only, so its save must not wait for the other replicas.
    Keras gives no other way to tell who called ``model.save``; saves are rare, so looking at the
    callers' frames costs nothing that matters.
    """
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), px_callbacks.CHIEF_ONLY):
            return True
        frame = frame.f_back
    return False


def _replica_device(strategy: "Strategy") -> Any:
    """Keras' device scope for the replica's device, where Keras would put its tensors elsewhere.

    On the torch backend Keras makes every tensor (variables, the batches it converts, metric
    state) on its default device: the GPU whenever one exists, also for CPU replicas (a notebook
    testing MirroredStrategy(["cpu:0", "cpu:1"]) after using its GPU got GPU metrics beside CPU
    weights). TF places a replica's ops on the replica's device; the core enters this around
    ``scope()`` and every ``run`` (None, at once, where Keras already uses that device).
    """
    wanted = strategy.extended.device
    if wanted.type == "cuda" and wanted.index is None:
        wanted = torch.device("cuda", torch.cuda.current_device())
    current = torch.device(keras_device())
    if current.type == "cuda" and current.index is None:
        current = torch.device("cuda", torch.cuda.current_device())
    return None if current == wanted else keras.device(str(wanted))
