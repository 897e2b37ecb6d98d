"""Keras metrics in custom training loops: ``result()`` reports the global value, as in TF.

In TF a metric created in ``strategy.scope()`` keeps its state in sync-on-read variables: each
replica adds its own examples inside ``strategy.run``, and reading ``result()`` in cross-replica
context aggregates over all replicas. Here every replica is a process with its own copy of the
metric, so phalanx adapts the metric *instance* (never the class) once it is used by a function
given to ``strategy.run``: in cross-replica context ``result()`` combines every replica's state
(each variable by its Keras ``aggregation``: ``sum``, ``mean`` or ``only_first_replica``), computes
the result from it, and leaves each replica's own state as it was, so ``update_state`` /
``reset_state`` keep their meaning. Inside ``run`` ``result()`` is the replica's own value (TF's too).

How a metric is found: the function given to ``run`` names it, directly or through functions it
calls by name (module globals or closure cells, two calls deep), which is how TF's tutorials and
most custom loops use metrics; or it is the function itself (``strategy.run(metric, args=...)``);
or a Keras layer the function names tracks it (a layer that updates its own metrics in ``call``).
``result()`` in cross-replica context is then a collective: call it on every replica (as
``strategy.reduce``), not only on the chief.

Under ParameterServerStrategy the metric's variables live on the parameter servers (as TF's do),
placed when a scheduled function first uses the metric: each worker adds its updates there (the
worker's in-place changes of non-trainable variables are sent as deltas), and ``result()`` on the
chief reads the servers' values first. ``reset_state()`` on the chief is sent to the servers with
the next scheduled function (call it after ``coordinator.join()``, as TF's tutorial does).

Example::

    with strategy.scope():
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    def step(x, y):
        accuracy.update_state(y, model(x))
    for x, y in dist_dataset:
        strategy.run(step, args=(x, y))
    print(float(accuracy.result()))   # over every replica's examples, on every replica
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras
import torch

from phalanx import nest
from phalanx.core import context
from phalanx.core.named_objects import objects_used_by
from phalanx.errors import PhalanxError
from phalanx.ps import pickling
from phalanx.values import ReduceOp

if TYPE_CHECKING:
    from phalanx.core.strategy import Strategy

_ATTR = "_phalanx_metric_strategy"
_FOUND: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


class UnsupportedMetricError(PhalanxError, TypeError):
    """A Keras metric used where its updates would be lost (a ParameterServerStrategy scheduled function)."""


def metrics_used_by(fn: Callable[..., Any]) -> list[Any]:
    """The Keras metrics ``fn`` uses: ``fn`` itself (``strategy.run(metric, args=...)``, or one of its
    methods), those it names (globals, closure, following called functions ``_DEPTH`` deep), and
    those the Keras layers it names track (a layer updating its own metrics in ``call``; a model's
    are left to ``fit``, which merges them itself)."""
    found = {id(m): m for m in objects_used_by(fn, keras.metrics.Metric)}
    owner = getattr(fn, "__self__", fn)
    if isinstance(owner, keras.metrics.Metric):
        found.setdefault(id(owner), owner)
    for layer in objects_used_by(fn, keras.layers.Layer):
        if not isinstance(layer, keras.Model):
            for metric in layer.metrics:
                found.setdefault(id(metric), metric)
    return list(found.values())


def observe_run(strategy: Strategy, fn: Callable[..., Any]) -> None:
    """Adapts the metrics ``fn`` uses (called by ``strategy.run`` before each step; cached per function)."""
    if strategy.num_replicas_in_sync == 1:
        return
    try:
        cached = _FOUND.get(fn)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is None:
        cached = tuple(metrics_used_by(fn))
        try:
            _FOUND[fn] = cached
        except TypeError:
            pass
    for metric in cached:
        if metric.__dict__.get(_ATTR) is None:
            adapt(metric, strategy)


def adapt(metric: Any, strategy: Strategy) -> Any:
    """Makes ``metric.result()`` global in cross-replica context (idempotent; see the module docstring)."""
    if metric.__dict__.get(_ATTR) is not None:
        return metric
    original = metric.result
    ref = weakref.ref(strategy)

    def result() -> Any:
        s = ref()
        if (
            s is None
            or s.num_replicas_in_sync == 1
            or (context.get_replica_context() is not None and context.get_strategy() is s)
        ):
            return original()
        return global_result(metric, s, original)

    object.__setattr__(metric, _ATTR, ref)
    object.__setattr__(metric, "result", result)
    return metric


_OPS = {"sum": ReduceOp.SUM, "none": ReduceOp.SUM, None: ReduceOp.SUM, "mean": ReduceOp.MEAN}


def global_result(metric: Any, strategy: Strategy, original: Callable[[], Any]) -> Any:
    """``original()`` computed from every replica's combined state; the local state is kept."""
    ext = strategy.extended
    variables = list(metric.variables)
    local = [v.value.detach().clone() for v in variables]
    combined: list[torch.Tensor | None] = [None] * len(variables)
    groups: dict[ReduceOp, list[int]] = {}
    for i, v in enumerate(variables):
        aggregation = getattr(v, "aggregation", "sum")
        if aggregation == "only_first_replica":
            t = local[i].clone()
            ext.broadcast([t])
            combined[i] = t
        else:
            groups.setdefault(_OPS.get(aggregation, ReduceOp.SUM), []).append(i)
    for op, idx in groups.items():
        for i, t in zip(idx, ext.all_reduce([local[i] for i in idx], op)):
            combined[i] = t
    try:
        for v, t in zip(variables, combined):
            v.assign(t.to(v.value.dtype))
        value = original()
        return nest.map_structure(lambda r: r.detach().clone() if isinstance(r, torch.Tensor) else r, value)
    finally:
        for v, t in zip(variables, local):
            v.assign(t)


_METRIC_KIND = "keras_metric"


def metric_reference(metric: Any, extended: Any) -> tuple:
    """What a scheduled function carries instead of the chief's metric (whose pickle copies its state):
    its config and its variables on the parameter servers, where the worker's copy adds its updates."""
    place_on_parameter_servers(metric, extended)
    specs = [extended.variable_json(v.value) for v in metric.variables]
    config = metric.__dict__.get("_phalanx_ps_config")
    if config is None:
        config = metric.__dict__["_phalanx_ps_config"] = json.dumps(keras.metrics.serialize(metric))
    return (str(id(metric)), config, specs)


def resolve_metric(service: Any, pid: tuple, run: Any) -> Any:
    """On a worker: the metric for ``pid`` (built once), its variables this run's copies of the servers'."""
    key, config, specs = pid
    metrics = service.extension_state(_METRIC_KIND)
    entry = metrics.get(key)
    if entry is None or entry[0] != config:
        metric = keras.metrics.deserialize(json.loads(config))
        if len(metric.variables) != len(specs):
            raise UnsupportedMetricError(
                f"the metric rebuilt on {service.task} has {len(metric.variables)} "
                f"variables; the chief's has {len(specs)}",
                hint="use a built-in or registered Keras metric",
            )
        for v, spec_json in zip(metric.variables, specs):
            service.adopt(spec_json, v.value)
        entry = metrics[key] = (config, metric)
    for spec_json in specs:
        service.bind(spec_json, run)  # read from the servers now; the change goes back as a delta
    return entry[1]


def place_on_parameter_servers(metric: Any, extended: Any) -> None:
    """Creates ``metric``'s variables on the parameter servers (once); ``result()`` reads them from there.

    Called on the chief when a scheduled function that uses ``metric`` is pickled. A metric made
    outside ``strategy.scope()`` is placed too: its variables are adopted by the servers here.
    """
    if metric.__dict__.get(_ATTR) is not None:
        return
    strategy = extended.container_strategy
    tensors = [v.value for v in metric.variables if extended.variable_json(v.value) is None]
    if tensors:
        extended.adopt_variables(tensors)  # creates them on the servers (chief only)
    original = metric.result
    names = [extended.server_variables.spec_of(v.value).name for v in metric.variables]

    def result() -> Any:
        extended.pull_variables(names)  # the sum of every worker's updates
        return original()

    object.__setattr__(metric, _ATTR, weakref.ref(strategy) if strategy is not None else (lambda: None))
    object.__setattr__(metric, "result", result)


# Under ParameterServerStrategy a metric used in a scheduled function travels as a reference: its
# variables are placed on the servers, and each worker's copy adds its updates there.
pickling.register_reference(_METRIC_KIND, keras.metrics.Metric, metric_reference, resolve_metric)
