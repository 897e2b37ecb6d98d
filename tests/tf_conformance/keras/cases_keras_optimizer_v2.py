"""Cases translated from tf_keras/distribute/keras_optimizer_v2_test.py and keras_models_test.py.

``testKerasOptimizerWithUnequalInput``: replica r's loss is (r + 1) * 0.5 * var, so the summed
gradient is 1.5 on two replicas; Adam(0.01, beta_1=0.2, beta_2=0.2) then gives TF's numbers
(var 1.99, m 1.2, v 1.8; then 1.98, 1.44, 2.16). TF runs it on CentralStorage over two GPUs; the
numbers hold for any two replicas, so it runs on every strategy of two (TF's ``minimize`` is
``backward()`` and ``apply``). On one replica the gradient is 0.5: var 1.99, m 0.4, v 0.2.
"""

from __future__ import annotations

import keras
import numpy as np
import torch

from tf_conformance.keras.common import all_close, loader, maybe_scope, replica_id, seed
from tf_conformance.registry import ALL, assert_close, case

SRC = "keras_optimizer_v2_test.py"


@case(f"{SRC} MirroredStrategyOptimizerV2Test.testKerasOptimizerWithUnequalInput", ALL)
def keras_optimizer_with_unequal_input(strategy, ctx):
    with strategy.scope():
        var = keras.Variable(2.0, name="var", aggregation="sum")
        optimizer = keras.optimizers.Adam(learning_rate=0.01, beta_1=0.2, beta_2=0.2)

    def model_fn():
        loss = (replica_id() + 1) * 0.5 * var.value
        var.value.grad = None
        loss.backward()
        optimizer.apply([var.value.grad], [var])

    def slots():
        found = [float(s.value) for s in optimizer.variables if s.path.endswith(("var_momentum", "var_velocity"))]
        # Under CentralStorage the slots exist on the chief only, beside the one copy of the variables.
        return [float(torch.as_tensor(var.value)), *(found or [0.0, 0.0])]

    expected = {
        2: ([1.99, 1.2, 1.8], [1.98, 1.44, 2.16]),
        1: ([1.99, 0.4, 0.2], [1.98, 0.48, 0.24]),
    }[ctx.n]
    # Read at the next step: under CentralStorage the chief updates the one copy during the step.
    strategy.run(model_fn)
    assert_close(strategy.run(slots) if ctx.n == 1 else _chief_read(strategy, slots), expected[0], "first step")
    strategy.run(model_fn)
    assert_close(_chief_read(strategy, slots), expected[1], "second step")


def _chief_read(strategy, read):
    """The values as the chief holds them (the optimizer slots live there under CentralStorage)."""
    values = torch.tensor(read(), dtype=torch.float64)
    strategy.extended.broadcast([values])
    return values.tolist()


@case(f"{SRC} MirroredStrategyOptimizerV2Test.testOptimizerWithKerasModelAndNumpyArrays", ALL)
def optimizer_with_keras_model_and_numpy_arrays(strategy, ctx):
    with strategy.scope():
        x = keras.Input(shape=(3,), name="input")
        model = keras.Model(x, keras.layers.Dense(4, name="dense")(x))
        model.compile(keras.optimizers.SGD(0.001), "mse", metrics=["mae"])
    inputs = np.zeros((64, 3), dtype=np.float32)
    targets = np.zeros((64, 4), dtype=np.float32)
    model.fit(inputs, targets, epochs=1, batch_size=2, verbose=0, validation_data=(inputs, targets))
    model.evaluate(inputs, targets, verbose=0)
    model.predict(inputs, verbose=0)


MODELS = "keras_models_test.py"


@case(f"{MODELS} KerasModelsTest.test_lstm_model_with_dynamic_batch")
def lstm_model_with_dynamic_batch(strategy, ctx):
    # TF: one sample of 32 frames of 64x64x3 (here 4 frames of 8x8x3): predict on a batch of one
    # row, which leaves the other replicas without rows.
    seed()
    input_data = np.random.random([1, 4, 8, 8, 3]).astype("float32")

    def build_model(distribution):
        with maybe_scope(distribution):
            model = keras.Sequential(
                [
                    keras.Input(input_data.shape[1:]),
                    keras.layers.ConvLSTM2D(4, kernel_size=(4, 4), activation="sigmoid", padding="same"),
                    keras.layers.GlobalMaxPooling2D(),
                    keras.layers.Dense(2, activation="sigmoid"),
                ]
            )
            model.compile(loss="binary_crossentropy", optimizer="adam")
        return model

    model = build_model(strategy)
    with strategy.scope():
        result = model.predict(input_data, verbose=0)
    assert result.shape == (1, 2), result.shape
    reference = build_model(None)
    reference.set_weights(model.get_weights())
    all_close(result, reference.predict(loader(input_data, batch_size=1), verbose=0), 1e-6, 1e-6, "predictions")
