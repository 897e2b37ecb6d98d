"""Cases translated from tf_keras/distribute/saved_model_save_load_test.py.

TF's own save and load (``tf.saved_model.save`` / ``tf.saved_model.load``, the model run through
its serving signature in ``strategy.run``), for Keras models and for a ``tf.Module``. A Keras 3
model on torch has no framework-level format of its own (its torch ``state_dict`` keys carry the
layers' unique names, so another instance cannot load it): the weights go through Keras 3's
weights file (``save_weights`` / ``load_weights`` into a model of the same kind) and the restored
model is called in ``strategy.run`` on the distributed predict batch, as TF calls its signature.
TF's ``tf.Module`` (``v * x``, v = 3) is a ``torch.nn.Module`` saved with ``torch.save`` of its
``state_dict`` and restored with ``torch.load(weights_only=True)``. TF runs them on its
single-worker strategies. ``test_no_variable_device_placement`` inspects the devices of a
SavedModel graph's ``ReadVariableOp`` nodes: a torch state has no graph and is not translated.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tf_conformance.keras import saved_models
from tf_conformance.keras.common import all_close, seed, shared_dir
from tf_conformance.registry import SINGLE_WORKER, case

SRC = "saved_model_save_load_test.py"


def _save_weights(model, folder):
    model.save_weights(str(folder / "model.weights.h5"))
    # Every replica runs this line: written whole and renamed, so that a replica reading it never
    # sees another one's truncated file (write_text alone raced: KeyError '').
    part = folder / f"kind.{os.getpid()}"
    part.write_text(type(model).__name__)
    os.replace(part, folder / "kind")


def _load_weights_and_run(strategy, folder, x_predict):
    kind = (folder / "kind").read_text()
    make = {
        "Functional": saved_models.functional_model,
        "Sequential": saved_models.sequential_model,
        "SimpleSubclassModel": saved_models.subclass_model,
    }[kind]
    model = make()
    model(np.zeros((1, 3), "float32"))  # built, as TF's restored object is
    model.load_weights(str(folder / "model.weights.h5"))
    return saved_models.run_per_replica(strategy, model, x_predict)


saved_models.register(
    saved_models.Harness("saved_model_save_load", _save_weights, _load_weights_and_run),
    f"{SRC} SavedModelKerasModelTest",
    case,
    SINGLE_WORKER,
    __name__,
)


class SimpleModule(torch.nn.Module):
    """TF's ``_SimpleModule``: ``v * x`` with v = 3."""

    def __init__(self):
        super().__init__()
        self.v = torch.nn.Parameter(torch.tensor(3.0))

    def forward(self, x):
        return self.v * x


def _save_module(model, folder):
    torch.save(model.state_dict(), folder / "module.pt")


def _load_module_and_run(strategy, folder, x_predict):
    model = SimpleModule()
    model.load_state_dict(torch.load(folder / "module.pt", weights_only=True))
    return saved_models.run_per_replica(strategy, model, x_predict)


class _ModuleHarness(saved_models.Harness):
    """TF's ``SavedModelTFModuleTest``: no training; the module's output on the predict batch,
    run in ``strategy.run`` per replica (or called without a strategy)."""

    def __init__(self):
        super().__init__("saved_model_tf_module", _save_module, _load_module_and_run)


def _module_case(scenario: str, save_in_scope: bool | None):
    def fn(strategy, ctx):
        seed()
        x_predict = np.random.rand(saved_models.BATCH_SIZE, 3).astype("float32")
        folder = shared_dir(f"saved_model_tf_module/{scenario}_{save_in_scope}")
        saving = None if scenario == "no_strategy_restore_strategy" else strategy
        with strategy.scope() if saving is not None else _null():
            model = SimpleModule()
        before = saved_models.run_per_replica(saving, model, x_predict)
        saved_models.save_once(lambda: _save_module(model, folder), distributed=False)
        restoring = None if scenario == "strategy_restore_no_strategy" else strategy
        with strategy.scope() if restoring is not None else _null():
            after = _load_module_and_run(restoring, folder, x_predict)
        all_close(after, before, 0, 0, "restored module")

    suffix = "" if save_in_scope is None else f"_{'in' if save_in_scope else 'out_of'}_scope"
    fn.__name__ = f"tf_module_save_{scenario}{suffix}"
    params = "" if save_in_scope is None else f" (save_in_scope {save_in_scope})"
    case(f"{SRC} SavedModelTFModuleTest.test_save_{scenario}{params}", SINGLE_WORKER)(fn)


def _null():
    import contextlib

    return contextlib.nullcontext()


_module_case("no_strategy_restore_strategy", None)
for _in_scope in (True, False):
    _module_case("strategy_restore_no_strategy", _in_scope)
    _module_case("strategy_restore_strategy", _in_scope)


@case(f"{SRC} SavedModelTFModuleTest.test_save_load_io_device", SINGLE_WORKER)
def save_load_io_device(strategy, ctx):
    # TF saves and loads through an I/O device ("/job:localhost"); torch reads onto the CPU
    # (map_location), and the module restored in the scope runs on every replica.
    folder = shared_dir("saved_model_tf_module/io_device")
    with strategy.scope():
        model = SimpleModule()
    saved_models.save_once(lambda: _save_module(model, folder), distributed=False)
    with strategy.scope():
        loaded = SimpleModule()
        loaded.load_state_dict(torch.load(folder / "module.pt", weights_only=True, map_location="cpu"))
    got = strategy.experimental_local_results(strategy.run(lambda: loaded(torch.ones(2)).detach()))
    all_close([np.asarray(g) for g in got], [np.full(2, 3.0)] * len(got), 0, 0, "outputs")
