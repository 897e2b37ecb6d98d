"""Keras 3 (torch backend) under every phalanx strategy: build and compile in ``scope()``, then ``fit``.

No import is needed: ``strategy.scope()`` imports this package when Keras is loaded (see
:mod:`phalanx.core.integrations`), as ``tf.keras`` is strategy-aware by itself; ``import
phalanx.keras`` does the same explicitly. A Keras model created inside ``strategy.scope()``
trains, evaluates and predicts distributed, with tf.keras' semantics: ``batch_size`` is the global
batch, split across the replicas; the update equals one-device training on that batch; the
losses and metrics in the progress bar, in ``History`` and from ``evaluate`` are aggregated over
all replicas (the same on every replica); ``predict`` returns each input row once, in order;
writing callbacks (``ModelCheckpoint``, ``TensorBoard``, ...) and the progress bar run on the
chief; a callback that stops training on one replica stops all of them.

Example (``train.py``; ``python train.py`` starts the second replica itself)::

    import os
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras
    import numpy as np
    import phalanx as px

    strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(np.random.rand(512, 64), np.random.randint(10, size=512), epochs=2, batch_size=64)

Importing this module sets ``KERAS_BACKEND=torch`` when Keras is not imported yet, checks that
the Keras is a supported one (``>=3.6,<3.16``) on the torch backend, and joins the core's
scope-enter hooks: from the first ``strategy.scope()`` on, one torch module-registration hook
(:mod:`phalanx.hooks`) finds the Keras models created in a strategy's scope. ``import phalanx``
and ``strategy.scope()`` never import Keras itself: a program that does not import Keras never
loads it.
"""

from __future__ import annotations

import os
import sys

if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "torch")

from phalanx.keras._version import SUPPORTED, UnsupportedKerasError, check_keras_version  # noqa: E402

try:
    import keras  # noqa: E402
except ImportError as e:  # pragma: no cover - depends on the environment
    raise UnsupportedKerasError(
        f"phalanx.keras needs Keras 3 ({SUPPORTED}); importing keras failed: {e}", hint="pip install -e '.[keras]'"
    ) from e

check_keras_version(getattr(keras, "__version__", "0"), keras.backend.backend())

from phalanx.core.extension_points import RUN_OBSERVERS  # noqa: E402
from phalanx.errors import InputMismatchError  # noqa: E402
from phalanx.keras.callbacks import Coordinator  # noqa: E402
from phalanx.keras.metrics import UnsupportedMetricError, observe_run  # noqa: E402
from phalanx.keras.model import (  # noqa: E402
    DistributedModel,
    PsAdapter,
    SyncAdapter,
    distribute,
    distributed_model,
)
from phalanx.keras.parameter_server import DatasetCreator, UnsupportedOptimizerError  # noqa: E402
from phalanx.keras.variables import observe_run as observe_variables  # noqa: E402

if observe_run not in RUN_OBSERVERS:
    RUN_OBSERVERS.append(observe_run)  # metrics used in custom loops report global values
if observe_variables not in RUN_OBSERVERS:
    RUN_OBSERVERS.append(observe_variables)  # Keras variables a step names get TF's aggregation

__all__ = [
    "Coordinator",
    "DatasetCreator",
    "DistributedModel",
    "InputMismatchError",
    "SUPPORTED",
    "PsAdapter",
    "SyncAdapter",
    "UnsupportedKerasError",
    "UnsupportedMetricError",
    "UnsupportedOptimizerError",
    "distribute",
    "distributed_model",
]
