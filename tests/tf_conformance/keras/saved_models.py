"""tf_keras/distribute/saved_model_test_base.py and model_combinations.py, translated.

A model (functional, Sequential or subclassed: one Dense of 5 units on 3 features, SGD(0.001), mse)
is trained under a strategy or none, its predictions taken, saved (in the scope or not), restored
under the strategy or none, and its predictions must be the same. What "save" and "load and run"
are is given by each test file (Keras' whole-model file, Keras' weights file, a torch module's
state). TF trains 100 steps of 10 rows; 5 here. TF restores under every pair of its strategies;
in one job the pairs are (this strategy, none), (none, this strategy) and (this strategy, itself).

Every replica runs the program: a model trained without a strategy exists on every replica, so it
is saved the porting guide's way (the chief writes, the others wait at ``phalanx.barrier()``); a
model under the strategy is saved by every replica's call (phalanx writes once).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import keras
import numpy as np
import torch

import phalanx as px
from tf_conformance.keras.common import all_close, loader, seed, shared_dir

BATCH_SIZE = 10
TRAIN_STEPS = 5
# TF's _TOLERANCE is 1e-30 (bitwise): every path here reproduces the same float32 computation.
TOLERANCE = 1e-6


def _compile(model):
    model.compile(loss="mse", metrics=["mae"], optimizer=keras.optimizers.SGD(learning_rate=0.001))
    return model


def functional_model():
    x = keras.Input(shape=(3,), dtype="float32")
    return _compile(keras.Model(inputs=x, outputs=keras.layers.Dense(5, dtype="float32", name="output_1")(x)))


def sequential_model():
    return _compile(keras.Sequential([keras.Input((3,)), keras.layers.Dense(5, dtype="float32", name="output_1")]))


@keras.saving.register_keras_serializable(package="tf_conformance")
class SimpleSubclassModel(keras.Model):
    """TF's ``_SimpleModel`` (registered, so that Keras' whole-model file can restore it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._dense_layer = keras.layers.Dense(5, dtype="float32")

    def call(self, inputs):
        return self._dense_layer(inputs)


def subclass_model():
    return _compile(SimpleSubclassModel())


MODELS: dict[str, Callable[[], Any]] = {
    "functional": functional_model,
    "sequential": sequential_model,
    "subclass": subclass_model,
}


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TF's ``_get_data_for_simple_models`` (the rows the steps use)."""
    x_train = np.random.rand(BATCH_SIZE * TRAIN_STEPS, 3).astype("float32")
    y_train = np.random.rand(BATCH_SIZE * TRAIN_STEPS, 5).astype("float32")
    x_predict = np.random.rand(BATCH_SIZE, 3).astype("float32")
    return x_train, y_train, x_predict


def train(model, x_train, y_train) -> None:
    model.fit(x=loader(x_train, y_train, batch_size=BATCH_SIZE), epochs=1, verbose=0)


def predict(model, x_predict) -> np.ndarray:
    return model.predict(loader(x_predict, batch_size=BATCH_SIZE), steps=1, verbose=0)


def run_per_replica(strategy, model, x_predict) -> np.ndarray:
    """TF's ``load_and_run_with_saved_model_api``: the restored model called in ``strategy.run`` on
    the distributed predict batch, the replicas' outputs concatenated (without a strategy: called)."""
    if strategy is None:
        return np.asarray(model(torch.as_tensor(x_predict)).detach())
    batch = next(iter(strategy.experimental_distribute_dataset(loader(x_predict, batch_size=BATCH_SIZE))))
    result = strategy.run(lambda x: model(x).detach(), args=(batch,))
    return np.concatenate([np.asarray(r) for r in strategy.experimental_local_results(result)], 0)


def save_once(save: Callable[[], None], distributed: bool) -> None:
    """``save()`` on every replica for a model under the strategy (phalanx writes once), else the
    porting guide's idiom: the chief writes, every replica waits for the file."""
    if distributed:
        save()
        return
    if px.is_chief():
        save()
    px.barrier()


class Harness:
    """One test file's save and load-and-run, over TF's three scenarios."""

    def __init__(self, name: str, save: Callable[[Any, Any], None], load_and_run: Callable[[Any, Any, Any], Any]):
        self.name = name
        self._save = save  # (model, folder)
        self._load_and_run = load_and_run  # (strategy or None, folder, x_predict) -> predictions

    def _folder(self, case: str):
        return shared_dir(f"{self.name}/{case}")

    def save_no_strategy_restore_strategy(self, strategy, model_name: str) -> None:
        seed()
        folder = self._folder(f"0_{model_name}")
        model = MODELS[model_name]()
        x_train, y_train, x_predict = data()
        train(model, x_train, y_train)
        before = predict(model, x_predict)
        save_once(lambda: self._save(model, folder), distributed=False)
        with strategy.scope():
            after = self._load_and_run(strategy, folder, x_predict)
        all_close(after, before, TOLERANCE, TOLERANCE, "restored under the strategy")

    def save_strategy_restore_no_strategy(self, strategy, model_name: str, save_in_scope: bool) -> None:
        seed()
        folder = self._folder(f"1_{model_name}_{save_in_scope}")
        with strategy.scope():
            model = MODELS[model_name]()
            x_train, y_train, x_predict = data()
            train(model, x_train, y_train)
            before = predict(model, x_predict)
        with strategy.scope() if save_in_scope else contextlib.nullcontext():
            save_once(lambda: self._save(model, folder), distributed=True)
        after = self._load_and_run(None, folder, x_predict)
        all_close(after, before, TOLERANCE, TOLERANCE, "restored without a strategy")

    def save_strategy_restore_strategy(self, strategy, model_name: str, save_in_scope: bool) -> None:
        seed()
        folder = self._folder(f"2_{model_name}_{save_in_scope}")
        with strategy.scope():
            model = MODELS[model_name]()
            x_train, y_train, x_predict = data()
            train(model, x_train, y_train)
            before = predict(model, x_predict)
        with strategy.scope() if save_in_scope else contextlib.nullcontext():
            save_once(lambda: self._save(model, folder), distributed=True)
        with strategy.scope():
            after = self._load_and_run(strategy, folder, x_predict)
        all_close(after, before, TOLERANCE, TOLERANCE, "restored under the strategy")


def register(
    harness: Harness, source: str, case: Callable, strategies: tuple[str, ...], module: str, models=tuple(MODELS)
) -> None:
    """Registers TF's three tests for each model (and save_in_scope True / False) as cases of ``module``."""
    for model_name in models:

        def no_strategy(strategy, ctx, _m=model_name):
            harness.save_no_strategy_restore_strategy(strategy, _m)

        no_strategy.__name__ = f"save_no_strategy_restore_strategy_{model_name}"
        no_strategy.__module__ = module
        case(f"{source}.test_save_no_strategy_restore_strategy ({model_name} model)", strategies)(no_strategy)
        for in_scope in (True, False):

            def to_none(strategy, ctx, _m=model_name, _s=in_scope):
                harness.save_strategy_restore_no_strategy(strategy, _m, _s)

            to_none.__name__ = f"save_strategy_restore_no_strategy_{model_name}_{'in' if in_scope else 'out_of'}_scope"
            to_none.__module__ = module
            case(
                f"{source}.test_save_strategy_restore_no_strategy ({model_name} model, save_in_scope {in_scope})",
                strategies,
            )(to_none)

            def to_same(strategy, ctx, _m=model_name, _s=in_scope):
                harness.save_strategy_restore_strategy(strategy, _m, _s)

            to_same.__name__ = f"save_strategy_restore_strategy_{model_name}_{'in' if in_scope else 'out_of'}_scope"
            to_same.__module__ = module
            case(
                f"{source}.test_save_strategy_restore_strategy ({model_name} model, save_in_scope {in_scope}; "
                "restored under the same strategy)",
                strategies,
            )(to_same)
