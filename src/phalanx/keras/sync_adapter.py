"""The adapter of a Keras model to a synchronous strategy (Mirrored, MultiWorkerMirrored, ...).

:class:`SyncAdapter` wraps the step functions Keras' trainer calls: each step takes this replica's
part of the global batch (:mod:`phalanx.keras.batches`), runs Keras' step inside
``strategy.run``, scales the gradients by the replica's share of the batch, all-reduces the
metrics' additive state and averages the non-trainable state a step updates. See
:mod:`phalanx.keras.model` for the whole adaptation and its semantics.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable

import keras
import numpy as np
import torch

from phalanx import nest
from phalanx._compat.torch import version_counter
from phalanx._sidetable import IdentityTable
from phalanx.core import rejoin
from phalanx.core.losses import mark_loss_scaled
from phalanx.errors import InputMismatchError, UnsupportedLayerError
from phalanx.input import global_batch
from phalanx.keras import callbacks as px_callbacks
from phalanx.keras import joining, sharding
from phalanx.values import ReduceOp

if TYPE_CHECKING:
    from phalanx.core.strategy import Strategy


from phalanx.keras.adapter import _KINDS, DistributedModel, _replica_device
from phalanx.keras.batches import (
    _batch_size,
    _is_distributed_input,
    _is_float,
    _LocalBatches,
    _LocalLoader,
    _SizedLocalBatches,
    _Step,
)
from phalanx.keras.optimizer_adapter import _OWN_STEPS, adapt_optimizer, held_optimizers


class _GradScale:
    """A gradient hook: multiplies by this replica's share of the batch during a training step.

    One per strategy, shared by all its models, and registered once per parameter, so that a
    layer shared by two models is scaled once.
    """

    def __init__(self) -> None:
        self.value = 1.0

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        value = self.value
        return grad if value == 1.0 else grad * value


_GRAD_SCALES: "weakref.WeakKeyDictionary[Any, _GradScale]" = weakref.WeakKeyDictionary()
# Side tables (phalanx._sidetable), instead of attributes on Keras' and torch's objects:
_RAW_STEP: IdentityTable[Callable[[Any], Any]] = IdentityTable()  # wrapped step function -> Keras' own
_SCALED: IdentityTable[_GradScale] = IdentityTable()  # parameter -> the scale hook registered on it


class SyncAdapter(DistributedModel):
    """Under a synchronous strategy: Keras' step functions run inside ``strategy.run`` on each
    replica's slice of the global batch, with gradient scaling, metric merging, statistics
    averaging and lazy-variable synchronisation (see the module docstring)."""

    def __init__(self, model: Any, strategy: "Strategy") -> None:
        self._grad_scale = _GRAD_SCALES.setdefault(strategy, _GradScale())
        self._synced: dict[int, torch.Tensor] = {}
        self._decorrelated = False
        self._checks_left = 0
        self._stat_vars: list[Any] | None = None  # non-trainable variables a training step updates
        self._sharded = False  # FullyShardedStrategy split the model's weights
        # Per step function: whether its batches come from a distributed dataset (already this
        # replica's part of the global batch) rather than whole global batches.
        self._local_input = {kind: False for kind in _KINDS}
        self._summed_loss = False  # the compiled loss is a sum over the batch (reduction="sum")
        # Why a replacement cannot join the current fit (phalanx.keras.joining.unplaceable), or None.
        self.join_refusal: str | None = None
        super().__init__(model, strategy)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        call, arguments = self._bind(type(model).fit, model, args, kwargs)
        user = _flat_callbacks(arguments.get("callbacks"))
        # A replacement (alone until it joins, at train begin) is never the chief of the group it joins.
        chief = self.is_chief and not joining.joining(self.strategy)
        if isinstance(arguments.get("callbacks"), keras.callbacks.CallbackList):
            # The caller built the list: keep it, and make sure it ends with one coordinator.
            cbl = arguments["callbacks"]
            cbl.callbacks = [cb for cb in cbl.callbacks if not isinstance(cb, px_callbacks.Coordinator)]
            coordinator = px_callbacks.Coordinator(self.strategy, cbl.callbacks, self)
            coordinator.set_model(model)
            cbl.callbacks.append(coordinator)
        else:
            arguments["callbacks"] = px_callbacks.for_replica(user, chief) + [
                px_callbacks.Coordinator(self.strategy, user, self)
            ]
        if not chief:
            arguments["verbose"] = 0
        self.join_refusal = joining.unplaceable(arguments.get("x"), arguments.get("steps_per_epoch"))
        arguments["x"] = self._local_batches(arguments.get("x"), arguments.get("steps_per_epoch"), "steps_per_epoch")
        validation = arguments.get("validation_data")
        if _is_distributed_input(validation):
            arguments["validation_data"] = self._local_batches(
                validation, arguments.get("validation_steps"), "validation_steps"
            )
        self._prepare()
        if self._sharded:
            sharding.check_callbacks(user)
        self._stat_vars = None
        # An elastic job's replacement joins fit at an epoch boundary (phalanx.keras.joining), not at a step.
        with self._on_replica_device(), self._reading("train", arguments["x"]), rejoin.at_epoch_boundaries(self._ext):
            return call(arguments)

    def adopt_alone(self) -> None:
        """A replacement, before it joins: the weights Keras built outside the scope (a model without
        an input shape) join the strategy's records and gradient synchronisation now, while it is
        alone (nothing to broadcast), as the members' did at their first steps."""
        built = [v.value for v in self.model.weights if not sharding.is_sharded(v) and id(v.value) not in self._synced]
        self._ext.adopt_variables(p for p in built if isinstance(p, torch.nn.Parameter))
        self._mark_synced(built)

    def regrouped(self) -> None:
        """A replacement joined ``fit`` at an epoch boundary: every replica looks again, as at a
        ``fit``'s first steps, for the state a step updates and for new variables, so that each
        makes the same collectives; the replacement's loss scaling is the group's (its ``fit``
        began alone)."""
        model = self.model
        _refuse_stateful_rnn(model, self.strategy)
        self._summed_loss = _summed_loss(model, self.strategy)
        self._checks_left, self._stat_vars = 2, None

    def _local_batches(self, value: Any, steps: Any, steps_name: str) -> Any:
        """A distributed dataset as ``fit`` / ``evaluate`` / ``predict`` take it (TF's Keras takes
        one): this replica's batches, each tagged with the size of its global batch; anything
        else as it is. TF's rule: the number of steps must be given, and the iterator is not
        restarted at each epoch (repeat the dataset as needed)."""
        if not _is_distributed_input(value):
            return value
        if steps is None:
            raise ValueError(
                f"When providing a distributed dataset, you must specify the number of steps to run: {steps_name} "
                f"is None for a {type(value).__name__}. Its batches are the replicas' parts of global batches, "
                "so Keras cannot count them; TF's Keras asks the same (repeat the dataset as needed)"
            )
        try:
            len(value)
        except TypeError:  # a DatasetFromFunction, or a DistributedDataset of an unsized iterable
            return _LocalLoader(_LocalBatches(value))
        return _LocalLoader(_SizedLocalBatches(value))

    @contextlib.contextmanager
    def _reading(self, kind: str, x: Any) -> Any:
        """Notes, for the duration of a call, whether the ``kind`` steps get this replica's batches."""
        before = self._local_input[kind]
        self._local_input[kind] = isinstance(x, _LocalLoader)
        try:
            yield
        finally:
            self._local_input[kind] = before

    def _on_replica_device(self) -> Any:
        """Keras' device scope for the replica's device, around fit, evaluate and predict (the
        batches Keras converts before each step, too): see :func:`_replica_device`."""
        return _replica_device(self.strategy) or contextlib.nullcontext()

    def _run_inference(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        call, arguments = self._bind(method, self.model, args, kwargs)
        passed = arguments.get("callbacks")
        if not isinstance(passed, keras.callbacks.CallbackList):  # fit's own list when validating
            if passed is not None:
                arguments["callbacks"] = px_callbacks.for_replica(_flat_callbacks(passed), self.is_chief)
            if not self.is_chief:
                arguments["verbose"] = 0
        arguments["x"] = self._local_batches(arguments.get("x"), arguments.get("steps"), "steps")
        kind = "predict" if method.__name__ == "predict" else "test"
        self._prepare()
        with self._on_replica_device(), self._reading(kind, arguments.get("x")):
            return call(arguments)

    # ------------------------------------------------------------------------------ step functions
    def _prepare(self) -> None:
        """Wraps the step functions Keras made (again after ``compile`` reset them)."""
        model = self.model
        _refuse_stateful_rnn(model, self.strategy)
        self._summed_loss = _summed_loss(model, self.strategy)
        self._checks_left = 2  # look for lazily built variables at the first two steps
        # The compiled optimizer, and any other a custom train_step uses (TF's WideDeepModel trains
        # each half with its own): every Keras optimizer the model holds as an attribute.
        optimizers = held_optimizers(model)
        for optimizer in optimizers:
            adapt_optimizer(optimizer)
        self._sharded = any(sharding.is_sharded(v) for v in model.trainable_weights)
        if self._sharded:
            for optimizer in optimizers:
                sharding.adapt_optimizer(optimizer)
        for kind in _KINDS:
            current = getattr(model, f"{kind}_function", None)
            if current is not None and current in _RAW_STEP:
                continue
            getattr(model, f"make_{kind}_function")(force=True)
            raw = getattr(model, f"{kind}_function")
            step = getattr(self, f"_{kind}_step")
            wrapped = functools.partial(step, raw)
            _RAW_STEP[wrapped] = raw
            setattr(model, f"{kind}_function", wrapped)

    def _run_local(
        self, raw: Callable[[Any], Any], step: _Step, scale_of: Callable[[_Step], float]
    ) -> tuple[Any, _Step]:
        """Runs Keras' step on this replica's part of ``step``'s batch; returns its result and the
        part it ran on (another one where an elastic job's group re-formed during the step)."""
        out: dict[str, Any] = {}

        def replica_fn() -> None:
            part = step
            if step.split is not None and step.split != (self._num_replicas, self._rank):
                part = _Step(step.batch, self._num_replicas, self._rank)  # the group re-formed: cut again
            out["step"] = part
            scale = scale_of(part)
            # The gradient synchronisation scales what it sums, bucket by bucket; a gradient hook
            # scales the rest (a sharded model's gathered parameters).
            self._grad_scale.value = scale
            mark_loss_scaled()
            try:
                with self._ext.gradient_sync.scaled(scale):
                    out["result"] = raw([part.local])
            finally:
                self._grad_scale.value = 1.0

        _OWN_STEPS.add(replica_fn)
        self.strategy.run(replica_fn)
        return out["result"], out["step"]

    def _begin(self, data: Any, kind: str) -> _Step:
        if self._checks_left > 0:
            self._checks_left -= 1
            self._sync_new_variables()
        if self._local_input[kind]:
            # Counted by the distributed dataset that cut it (the job report's samples per second).
            return _Step.local(data[0], self._global_size_of(data[0]))
        step = _Step(data[0], self._num_replicas, self._rank)
        self._ext.stats.add_samples(step.global_size)  # the job report's samples per second
        return step

    def _global_size_of(self, batch: Any) -> int:
        """The size of the global batch this replica's ``batch`` was cut from (its tag, or the sum
        of the replicas' sizes where Keras copied the tensors)."""
        info = global_batch.find((batch,), {})
        if info is not None:
            return info.global_size
        size = torch.tensor([float(_batch_size(batch))], dtype=torch.float64)
        return round(float(self._ext.all_reduce([size], ReduceOp.SUM)[0][0]))

    def _train_step(self, raw: Callable[[Any], Any], data: Any) -> Any:
        step = self._begin(data, "train")
        model = self.model
        metric_vars = self._metric_variables()
        saved = self._zero(metric_vars)
        versions = None
        if self._stat_vars is None and self._num_replicas > 1:
            candidates = [v for v in model.non_trainable_weights if _is_float(v)]
            versions = [version_counter(v.value) for v in candidates]
        # A mean over the replica's rows is scaled by its share of the global batch; a sum over
        # them (reduction="sum") is already its part of the global sum (a stand-in row: 0).
        summed = self._summed_loss
        logs, step = self._run_local(raw, step, lambda part: (0.0 if part.empty else 1.0) if summed else part.share)
        if versions is not None:
            changed = torch.tensor(
                [float(version_counter(v.value) != before) for v, before in zip(candidates, versions)]
            )
            changed = self._ext.all_reduce([changed], ReduceOp.SUM)[0] if len(candidates) else changed
            self._stat_vars = [v for v, c in zip(candidates, changed.tolist()) if c > 0]
        stat_vars = self._stat_vars or []
        # In float64, so that a value every replica updated alike comes back exactly.
        extra = [v.value.detach().double() * step.share for v in stat_vars]
        reduced_extra = self._merge(step, metric_vars, saved, extra)
        with torch.no_grad():
            for v, value in zip(stat_vars, reduced_extra):
                v.assign(value.to(v.value.dtype))
        return self._global_logs(logs, step)

    def _test_step(self, raw: Callable[[Any], Any], data: Any) -> Any:
        step = self._begin(data, "test")
        metric_vars = self._metric_variables()
        saved = self._zero(metric_vars)
        logs, step = self._run_local(raw, step, lambda _: 1.0)
        if self._sharded:
            sharding.reshard(self.model)
        self._merge(step, metric_vars, saved, [])
        return self._global_logs(logs, step)

    def _predict_step(self, raw: Callable[[Any], Any], data: Any) -> Any:
        first = self._checks_left > 0
        step = self._begin(data, "predict")
        outputs, step = self._run_local(raw, step, lambda _: 1.0)
        if first and self._num_replicas > 1 and self._has_unsynced_variables():
            # predict() does not build the model first: it was built by this very step, with each
            # replica's own initial values. Make them the chief's and compute the step again.
            self._sync_new_variables()
            outputs, step = self._run_local(raw, step, lambda _: 1.0)
        if self._sharded:
            sharding.reshard(self.model)
        if self._num_replicas == 1:
            return outputs

        def gather(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            return self._ext.all_gather(t[:0] if step.empty else t, 0)

        return nest.map_structure(gather, outputs)

    # ------------------------------------------------------------------------------ metrics
    def _metric_variables(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for metric in self.model.metrics:
            for v in metric.variables:
                seen.setdefault(id(v), v)
        return list(seen.values())

    def _loss_totals(self, metric_vars: list[Any]) -> list[int]:
        """Where the loss tracker's running total is in ``metric_vars``."""
        totals = {id(v) for m in self.model.metrics if m.name == "loss" for v in m.variables if v.name == "total"}
        return [i for i, v in enumerate(metric_vars) if id(v) in totals]

    def _zero(self, variables: list[Any]) -> list[torch.Tensor]:
        """Saves the (global) metric state and zeroes it, so the step leaves only its contribution."""
        if self._num_replicas == 1:
            return []
        saved = [v.value.detach().clone() for v in variables]
        for v in variables:
            v.assign(torch.zeros_like(v.value))
        return saved

    def _merge(
        self, step: _Step, metric_vars: list[Any], saved: list[torch.Tensor], extra: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Global metric state = saved + every replica's contribution; ``extra`` summed.

        One collective per dtype (float32 metrics, the float64 ``extra``), shared with the check
        that every replica was fed a global batch of the same size.
        """
        if self._num_replicas == 1:
            return extra
        contributions = [torch.zeros_like(v.value) if step.empty else v.value.detach().clone() for v in metric_vars]
        if self._summed_loss and not step.empty:
            # The loss tracker averages each replica's loss weighted by its rows; a summed loss is a
            # part of the global sum, so the replica's total counts 1/share times: the result is the sum.
            for i in self._loss_totals(metric_vars):
                contributions[i] = contributions[i] / step.share
        header = torch.tensor([float(step.global_size)], dtype=torch.float32)
        reduced = self._ext.all_reduce([header, *contributions, *extra], ReduceOp.SUM)
        if round(float(reduced[0][0])) != step.global_size * self._num_replicas:
            raise InputMismatchError(
                f"Replicas disagree on the size of the global batch at step {self._ext.step}: this replica "
                f"({self._ext.process_name()}) has {step.global_size}, the sum over "
                f"{self._num_replicas} replicas is {float(reduced[0][0]):g}.",
                hint="every worker must call fit/evaluate/predict with the same data and batch_size; "
                "batch_size is the global batch",
            )
        n = len(metric_vars)
        for v, base, total in zip(metric_vars, saved, reduced[1 : 1 + n]):
            v.assign(base + total.to(base.dtype))
        return list(reduced[1 + n :])

    def _global_logs(self, logs: Any, step: _Step) -> Any:
        """Replaces the step's local metric values by the global ones (the same on every replica)."""
        if self._num_replicas == 1 or not isinstance(logs, dict):
            return logs
        metric_logs = self.model.get_metrics_result()
        result = {k: metric_logs.get(k, v) for k, v in logs.items()}
        # Values a custom train_step returns that are not model metrics: average by batch share.
        custom = sorted(k for k, v in logs.items() if k not in metric_logs and _is_scalar(v))
        if custom:
            values = torch.tensor([float(logs[k]) * step.share for k in custom], dtype=torch.float64)
            reduced = self._ext.all_reduce([values], ReduceOp.SUM)[0]
            result.update({k: float(x) for k, x in zip(custom, reduced.tolist())})
        return result

    # ------------------------------------------------------------------------------ variables
    def _mark_synced(self, params: Any) -> None:
        for p in params:
            self._synced[id(p)] = p

    def _has_unsynced_variables(self) -> bool:
        return any(not sharding.is_sharded(v) and id(v.value) not in self._synced for v in self.model.weights)

    def _sync_new_variables(self) -> None:
        """Broadcasts variables the scope did not see (built lazily) and synchronises their gradients."""
        model = self.model
        weights = model.weights
        # (A sharded weight was synchronised when it was sharded; its value is a shard or the
        # gathered tensor by turns.)
        new = [v.value for v in weights if not sharding.is_sharded(v) and id(v.value) not in self._synced]
        if new and self._num_replicas > 1:
            # A collective: every replica reaches it at the same step. (Those the strategy
            # captured, in scope or inside run, it synchronises itself: adopt_variables skips them.)
            self._ext.adopt_variables(p for p in new if isinstance(p, torch.nn.Parameter))
        for p in new:
            self._synced[id(p)] = p
        if self._num_replicas > 1:
            # Weights thawed since the last look (fine-tuning after compile) join the strategy's
            # gradient synchronisation now, so that it is known which of them it scales itself.
            self._ext.sync_variables()
            for v in model.trainable_weights:
                # A sharded weight's gradient is computed for its gathered parameter.
                gathered = sharding.gathered_parameter(v)
                p = v.value if gathered is None else gathered
                if p.requires_grad and p not in _SCALED and not self._ext.gradient_sync.scales(p):
                    p.register_hook(self._grad_scale)
                    _SCALED[p] = self._grad_scale
            if not self._decorrelated:
                self._decorrelated = True
                self._decorrelate_seeds(model)

    def _decorrelate_seeds(self, model: Any) -> None:
        """Gives each replica its own dropout (and other random-layer) stream.

        Seed-generator state created in scope was broadcast from the chief, so replicas would draw
        the same masks for their different rows; offsetting the seed by the replica index keeps
        the chief's stream (and one-device behaviour) and makes the others independent.
        """
        if self._rank == 0:
            return
        for v in model.variables:
            if v.path.endswith("seed_generator_state") and not _is_float(v):
                offset = torch.tensor([self._rank * 1_000_003, 0], dtype=v.value.dtype)
                v.assign(v.value + offset)


def _summed_loss(model: Any, strategy: "Strategy") -> bool:
    """Whether ``model``'s compiled loss sums over the batch (``reduction="sum"``) rather than
    averaging: its replicas' gradients then add up without scaling, as TF sums them (its Keras
    scales only mean reductions by the number of replicas).

    Raises:
        ValueError: under several replicas, a sum mixed with means (several losses), or a sum
            with losses the model adds itself (regularisers, ``add_loss``): one scale per step
            cannot serve both.
    """
    losses = [loss for loss in nest.flatten(getattr(model, "loss", None)) if loss is not None]
    summed = [getattr(loss, "reduction", None) == "sum" for loss in losses]
    if not any(summed) or strategy.num_replicas_in_sync == 1:
        return False
    if not all(summed) or len(losses) > 1 or model.losses:
        raise ValueError(
            f"The model's loss sums over the batch (reduction='sum') beside other losses "
            f"({len(losses)} compiled, {len(model.losses)} added by the model); under "
            f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas phalanx scales a step's "
            "gradients once, so it cannot sum one loss and average the others. Use "
            "reduction='sum_over_batch_size' (and a learning rate times the batch size), or one summed loss alone"
        )
    return True


def _refuse_stateful_rnn(model: Any, strategy: "Strategy") -> None:
    """A stateful RNN keeps one state row per row of the batch it was built for; on several replicas
    each replica sees another part of every batch, so the states would be mixed up. tf_keras refuses
    such a layer in a strategy's scope (``base_rnn.py``): so does phalanx, when the model joins a
    strategy of more than one replica and at each ``fit``/``evaluate``/``predict``."""
    if strategy.num_replicas_in_sync == 1:
        return
    for layer in _all_layers(model):
        if getattr(layer, "stateful", False) is True:  # RNN layers and their wrappers (Bidirectional)
            raise UnsupportedLayerError(
                layer,
                "Stateful RNNs (created with `stateful=True`) are not yet supported with tf.distribute.Strategy, "
                f"nor under {type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas: each replica "
                "computes on its own part of every batch, so the layer's states would not follow the rows",
                hint="train a stateful RNN on one replica (OneDeviceStrategy), or make it stateless "
                "(stateful=False) and pass the states explicitly",
            )


def _all_layers(model: Any) -> list[Any]:
    """Every layer of ``model``, nested models' layers included."""
    out: list[Any] = []
    for layer in getattr(model, "layers", []):
        out.append(layer)
        if isinstance(layer, keras.Model):
            out.extend(_all_layers(layer))
    return out


def _is_scalar(value: Any) -> bool:
    if isinstance(value, (int, float, np.floating, np.integer)):
        return True
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def _flat_callbacks(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return list(callbacks.callbacks)
    if isinstance(callbacks, (list, tuple)):
        return [cb for item in callbacks for cb in _flat_callbacks(item)]
    return [callbacks]
