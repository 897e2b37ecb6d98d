"""Cases translated from tf_keras/distribute/custom_training_loop_models_test.py.

Keras layers, functional and subclassed models, BatchNormalization, an LSTM and a module holding
Keras layers, trained in custom loops inside ``strategy.run``. TF's ``tape.gradient(loss,
variables)`` is ``torch.autograd.grad`` where the test returns the gradients (TF returns each
replica's own) and ``loss.sum().backward()`` where it applies them (``apply_gradients`` sums them
across replicas, as ``backward()`` does here). TF's tests only run the loops; where they state no
value, the cases check what TF guarantees: every replica ends with the same variables, and they
equal one device's.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import torch

import phalanx as px
from tf_conformance.keras.common import all_close, loader, replicas_agree, seed, shared_dir
from tf_conformance.registry import case

SRC = "custom_training_loop_models_test.py"
CLS = "KerasModelsTest"


def _dataset():
    """TF's ``_get_dataset``: 31 rows of zeros in batches of 10 (a last batch of one row)."""
    return loader(np.zeros((31, 3), np.float32), np.zeros((31, 4), np.float32), batch_size=10)


def _model():
    x = keras.Input(shape=(3,), name="input")
    return keras.Model(x, keras.layers.Dense(4, name="dense")(x))


def _apply_step(model, optimizer, inputs, training=None):
    """TF's step: the loss over this replica's rows, its gradients summed over the replicas, applied."""
    images, targets = inputs
    outputs = model(images) if training is None else model(images, training=training)
    loss = keras.losses.mean_squared_error(targets, outputs)
    model.zero_grad()
    loss.sum().backward()
    optimizer.apply_gradients(zip([v.value.grad for v in model.trainable_variables], model.trainable_variables))
    return loss.detach()


def _one_device(make, initial, batches, optimizer_fn, training=None):
    """The same steps without a strategy, on the global batches."""
    model = make()
    model.set_weights(initial)
    optimizer = optimizer_fn()
    for batch in batches:
        _apply_step(model, optimizer, batch, training)
    return model.get_weights()


def _train_and_compare(strategy, make, optimizer_fn, batches, steps=None, training=None):
    seed()
    with strategy.scope():
        model = make()
        optimizer = optimizer_fn()
    initial = model.get_weights()
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    used = []
    for i, x in enumerate(iterator):
        if steps is not None and i == steps:
            break
        strategy.run(_apply_step, args=(model, optimizer, x, training))
        used.append(i)
    replicas_agree(strategy, model.get_weights(), "weights")
    global_batches = [b for i, b in enumerate(batches) if i in used]
    all_close(model.get_weights(), _one_device(make, initial, global_batches, optimizer_fn, training), 1e-6, 1e-6)


def _local_grads(strategy, layer_or_model, x_and_y):
    def step_fn(inputs):
        images, targets = inputs
        loss = keras.losses.mean_squared_error(targets, layer_or_model(images))
        variables = [v.value for v in layer_or_model.variables]
        return torch.autograd.grad(loss.sum(), variables)

    outputs = strategy.run(step_fn, args=(x_and_y,))
    return [strategy.experimental_local_results(g) for g in outputs]


@case(f"{SRC} {CLS}.test_single_keras_layer_run")
def single_keras_layer_run(strategy, ctx):
    with strategy.scope():
        model = keras.layers.Dense(4, name="dense")
    grads = _local_grads(strategy, model, next(iter(strategy.experimental_distribute_dataset(_dataset()))))
    # TF 2.21 CPU returns, per replica, the (zero) gradients of the kernel and the bias.
    assert [len(g) for g in grads] == [ctx.local_n, ctx.local_n], grads
    assert all(float(t.abs().max()) == 0.0 for g in grads for t in g), grads


@case(f"{SRC} {CLS}.test_keras_model_optimizer_run")
def keras_model_optimizer_run(strategy, ctx):
    _train_and_compare(strategy, _model, keras.optimizers.RMSprop, _dataset())


@case(f"{SRC} {CLS}.test_keras_subclass_model_optimizer_run")
def keras_subclass_model_optimizer_run(strategy, ctx):
    class KerasSubclassModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.l = keras.layers.Dense(4, name="dense")

        def call(self, x):
            return self.l(x)

    def make():
        model = KerasSubclassModel()
        model(np.zeros((1, 3), np.float32))  # TF builds it at the first step; built here to compare
        return model

    _train_and_compare(strategy, make, keras.optimizers.RMSprop, _dataset(), steps=1)


@case(f"{SRC} {CLS}.test_keras_model_optimizer_run_loop")
def keras_model_optimizer_run_loop(strategy, ctx):
    _train_and_compare(strategy, _model, keras.optimizers.RMSprop, _dataset(), steps=4)


@case(f"{SRC} {CLS}.test_batch_norm_with_dynamic_batch")
def batch_norm_with_dynamic_batch(strategy, ctx):
    inputs = np.zeros((10, 3, 3, 3), dtype=np.float32)
    targets = np.zeros((10, 4), dtype=np.float32)

    def make():
        x = keras.Input(shape=(3, 3, 3), name="input")
        y = keras.layers.BatchNormalization(name="bn")(x)
        y = keras.layers.Flatten()(y)
        return keras.Model(x, keras.layers.Dense(4, name="dense")(y))

    # Zero inputs: each replica's batch statistics are one device's, so the step matches it.
    _train_and_compare(strategy, make, keras.optimizers.RMSprop, loader(inputs, targets, batch_size=10), 1, True)


@case(f"{SRC} {CLS}.test_lstm")
def lstm(strategy, ctx):
    seed()
    batch_size = 32
    x = np.random.rand(batch_size, 10, 1).astype("float32")
    y = np.random.rand(batch_size, 1).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((10, 1)), keras.layers.LSTM(1, return_sequences=False)])
        optimizer = keras.optimizers.SGD()
    initial = model.get_weights()

    def step_fn(inputs):
        inps, targ = inputs
        output = model(inps)
        loss = px.nn.compute_average_loss(
            keras.losses.binary_crossentropy(targ, output, from_logits=False), global_batch_size=batch_size
        )
        model.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
        missing.extend(v.path for v, g in zip(model.trainable_variables, grads) if g is None)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss.detach()

    missing: list[str] = []
    batch = next(iter(strategy.experimental_distribute_dataset(loader(x, y, batch_size=batch_size))))
    strategy.experimental_local_results(strategy.run(step_fn, args=(batch,)))
    # TF's model has only LSTM variables "so we can detect no gradient issues more easily". (Under
    # CentralStorage the chief alone receives the summed gradients, by design.)
    if ctx.rank == 0 or not getattr(strategy.extended, "updates_on_chief_only", False):
        assert not missing, f"no gradient for {missing}"
    replicas_agree(strategy, model.get_weights(), "weights")
    reference = keras.Sequential([keras.Input((10, 1)), keras.layers.LSTM(1, return_sequences=False)])
    reference.set_weights(initial)
    loss = keras.ops.mean(keras.losses.binary_crossentropy(torch.as_tensor(y), reference(torch.as_tensor(x))))
    reference.zero_grad()
    loss.backward()
    keras.optimizers.SGD().apply_gradients(
        zip([v.value.grad for v in reference.trainable_variables], reference.trainable_variables)
    )
    all_close(model.get_weights(), reference.get_weights(), 1e-6, 1e-6, "weights")


def _nested_model():
    x = keras.Input(shape=(3,), name="input")
    return keras.Model(x, keras.layers.Dense(4, name="dense")(x))


@case(f"{SRC} {CLS}.test_nested_tf_functions")
def nested_tf_functions(strategy, ctx):
    seed()
    inputs = np.random.random((10, 3)).astype(np.float32)
    targets = np.ones((10, 4), dtype=np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset(loader(inputs, targets, batch_size=10))))
    with strategy.scope():
        model = _nested_model()
        # TF's one legacy optimizer served both models; a Keras 3 optimizer serves the variables it
        # was built for, so each model has its own, alike.
        optimizer = keras.optimizers.SGD(0.1, momentum=0.01)
        optimizer2 = keras.optimizers.SGD(0.1, momentum=0.01)
        weights_file = str(shared_dir("nested_tf_functions") / "model.weights.h5")
        model.save_weights(weights_file)
        model2 = _nested_model()
        model2.load_weights(weights_file)
    all_close(model2.get_weights(), model.get_weights(), 0, 0, "loaded")

    def compute_loss(images, targets):
        return keras.losses.mean_squared_error(targets, model(images))

    def compute_loss2(images, targets):  # TF: a nested tf.function
        return keras.losses.mean_squared_error(targets, model2(images))

    def step(m, opt, loss_fn):
        def step_fn(batch):
            images, targets = batch
            loss = loss_fn(images, targets)
            m.zero_grad()
            loss.sum().backward()
            opt.apply_gradients(zip([v.value.grad for v in m.trainable_variables], m.trainable_variables))

        strategy.run(step_fn, args=(batch,))

    step(model, optimizer, compute_loss)
    step(model2, optimizer2, compute_loss2)
    all_close(model2.get_weights(), model.get_weights(), 1e-6, 1e-6, "after a step")


@case(f"{SRC} {CLS}.test_nested_tf_functions_with_control_flow")
def nested_tf_functions_with_control_flow(strategy, ctx):
    seed()
    inputs = np.random.random((10, 3)).astype(np.float32)
    targets = np.ones((10, 4), dtype=np.float32)
    batches = loader(np.concatenate([inputs] * 10), np.concatenate([targets] * 10), batch_size=10)  # TF: repeat()
    _train_and_compare(strategy, _nested_model, lambda: keras.optimizers.SGD(0.1, momentum=0.01), batches, steps=10)


class CustomModel(torch.nn.Module):
    """TF's ``CustomModel(tf.Module)``: a module (torch's, here) holding a list of Keras layers."""

    def __init__(self):
        super().__init__()
        self._layers = torch.nn.ModuleList([keras.layers.Dense(4, name="dense")])

    def forward(self, x):
        for layer in self._layers:
            x = layer(x)
        return x


@case(f"{SRC} {CLS}.test_customized_tf_module_run")
def customized_tf_module_run(strategy, ctx):
    with strategy.scope():
        model = CustomModel()

    def step_fn(inputs):
        images, targets = inputs
        loss = keras.losses.mean_squared_error(targets, model(images))
        return torch.autograd.grad(loss.sum(), list(model.parameters()))

    batch = next(iter(strategy.experimental_distribute_dataset(_dataset())))
    grads = [strategy.experimental_local_results(g) for g in strategy.run(step_fn, args=(batch,))]
    assert [len(g) for g in grads] == [ctx.local_n, ctx.local_n], grads
    replicas_agree(strategy, [p.detach() for p in model.parameters()], "variables")


@case(f"{SRC} {CLS}.test_reduce_loss")
def reduce_loss(strategy, ctx):
    inputs = np.zeros((10, 4), dtype=np.float32)
    targets = np.zeros((10, 1), dtype=np.float32)
    seed()
    with strategy.scope():
        x = keras.Input(shape=(4,), name="input")
        model = keras.Model(x, keras.layers.Dense(3, name="dense")(x))

    def step_fn(batch):
        images, targets = batch
        return keras.losses.sparse_categorical_crossentropy(targets, model(images))

    batch = next(iter(strategy.experimental_distribute_dataset(loader(inputs, targets, batch_size=10))))
    loss = strategy.reduce(px.ReduceOp.MEAN, strategy.run(step_fn, args=(batch,)), axis=0)
    # TF states no value: the mean over the 10 rows, as one device computes it (NaN: zero outputs
    # taken as probabilities, in TF too).
    expected = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(targets, model(inputs)))
    all_close(loss, expected, 1e-6, 1e-6, "mean loss", equal_nan=True)


@case(f"{SRC} {CLS}.test_variable_run_argument")
def variable_run_argument(strategy, ctx):
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
        net = keras.layers.Dense(1, trainable=True)
        net.build((None, 1))
    features = next(iter(strategy.experimental_distribute_dataset(loader(np.ones((2, 1), np.float32), batch_size=2))))
    kinds = []
    variable_type = type(net.trainable_variables[0])  # Keras 3.6's torch variables are no keras.Variable

    def replica_step(trainable_variables, features):
        # TF: the variables passed to run() stay variables (TPUStrategy used to make them tensors).
        kinds.append(all(type(v) is variable_type for v in trainable_variables))
        net_out = net(features, training=True)
        loss = ((net_out - 1.0) * (net_out - 1.0)).sum()
        net.zero_grad()
        loss.backward()
        optimizer.apply_gradients(zip([v.value.grad for v in trainable_variables], trainable_variables))
        return loss.detach()

    per_replica = strategy.run(replica_step, args=(net.trainable_variables, features))
    strategy.reduce(px.ReduceOp.SUM, per_replica, axis=None)
    assert kinds == [True], kinds
    replicas_agree(strategy, net.get_weights(), "weights")


class _Heads(keras.Model):
    """A trunk, a head, and an auxiliary head that the loss uses on even steps only."""

    def __init__(self):
        super().__init__()
        self.trunk = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(1)
        self.aux = keras.layers.Dense(1)

    def call(self, x, use_aux=False):
        h = self.trunk(x)
        return (self.head(h), self.aux(h)) if use_aux else (self.head(h), None)


def _unused_layer_loop(strategy, optimizer_fn):
    seed()
    global_batch, steps = 8, 6
    x = np.random.normal(size=(global_batch * steps, 4)).astype("float32")
    y = np.random.normal(size=(global_batch * steps, 1)).astype("float32")

    def build():
        model = _Heads()
        model(np.zeros((1, 4), "float32"), use_aux=True)
        return model

    initial = build().get_weights()

    def train(distribution):
        with distribution.scope() if distribution is not None else contextlib.nullcontext():
            model = build()
            model.set_weights(initial)
            optimizer = optimizer_fn()

        def step_fn(inputs, step):
            xb, yb = inputs
            out, aux = model(xb, use_aux=step % 2 == 0)
            per_example = keras.ops.squeeze(keras.ops.square(out - yb), -1)
            if aux is not None:
                per_example = per_example + 0.5 * keras.ops.squeeze(keras.ops.square(aux), -1)
            loss = px.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            model.zero_grad()
            loss.backward()
            variables = model.trainable_variables
            optimizer.apply([v.value.grad for v in variables], variables)
            return loss.detach()

        data = loader(x, y, batch_size=global_batch)
        if distribution is None:
            for step, batch in enumerate(data):
                step_fn(batch, step)
        else:
            for step, batch in enumerate(distribution.experimental_distribute_dataset(data)):
                distribution.run(step_fn, args=(batch, step))
        return model.get_weights()

    got = train(strategy)
    replicas_agree(strategy, got, "weights")
    # One device leaves the auxiliary head alone at odd steps (its gradient is None, so the
    # optimizer skips it: momentum does not move it, weight decay does not shrink it).
    all_close(got, train(None), 1e-5, 1e-5, "weights")


@case(
    "distribute_strategy_test.py TestDistributionStrategyWithNumpyArrays.test_gradients_are_none (in a custom loop: "
    "an auxiliary head unused at odd steps, SGD with momentum, optimizer.apply in strategy.run, against one device)"
)
def unused_layer_in_custom_loop_sgd_momentum(strategy, ctx):
    _unused_layer_loop(strategy, lambda: keras.optimizers.SGD(0.1, momentum=0.9))


@case(
    "distribute_strategy_test.py TestDistributionStrategyWithNumpyArrays.test_gradients_are_none (in a custom loop: "
    "an auxiliary head unused at odd steps, AdamW with weight decay, against one device)"
)
def unused_layer_in_custom_loop_adamw(strategy, ctx):
    _unused_layer_loop(strategy, lambda: keras.optimizers.AdamW(0.05, weight_decay=0.5))
