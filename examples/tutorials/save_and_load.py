# Port of tensorflow/docs site/en/tutorials/distribute/save_and_load.ipynb
# ("Save and load a model using a distribution strategy").
# Run: phalanx run -n 2 examples/tutorials/save_and_load.py   (MirroredStrategy, 2 CPU replicas)
#
# About 30 lines changed beyond the rename (README "Porting from TensorFlow").
# Every tf.distribute call is kept, renamed to phalanx. Lines changed beyond the rename:
#   1. data: tfds.load('mnist') -> scikit-learn's digits (8x8x1); map/cache/shuffle/batch ->
#      TensorDataset + DataLoader(shuffle=True); predict_dataset.take(1) -> the first batch.
#   2. Keras 3: model paths need ".keras" ("/tmp/keras_save" -> "keras_save.keras");
#      tf.metrics -> keras.metrics; SaveOptions/LoadOptions(experimental_io_device=...) dropped
#      (there is no remote io device; the section saves and loads with the Keras API as before).
#   3. The low-level tf.saved_model API has no TensorFlow-free equivalent in Keras 3; its nearest
#      counterparts are used:
#      - tf.saved_model.save(model, path) -> model.export(path, format="torch", dynamic_shapes=...)
#        (a torch.export program: graph and weights, loadable without the model's Python code);
#        tf.saved_model.load(path).signatures["serving_default"] -> torch.export.load(path).module().
#      - the hub.KerasLayer section (train the loaded program further) is left out: see there.
#      - "Keras save, low-level load" (tf.saved_model.load of a Keras file): a .keras file is not
#        a torch program, so it is loaded with keras.models.load_model.
#      - the subclassed model without inputs: tf.saved_model.save -> phalanx's Checkpoint, which
#        saves any model by its object graph and restores into a fresh copy built later.
#   4. epochs=2 kept; /tmp paths -> the working directory.
#   5. Added: the checks that every load gives the saved model's predictions, that training
#      lowered the loss, and that the replicas agree (every save is written once, by the chief:
#      phalanx does that for model.save / export and Checkpoint under a multi-replica strategy).
import os

os.environ.setdefault("KERAS_BACKEND", "torch")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import phalanx  # noqa: E402
import phalanx.checkpoint  # noqa: E402

mirrored_strategy = phalanx.MirroredStrategy()


def get_data():
    digits = load_digits()
    images = (digits.images[..., None] / np.float32(16)).astype(np.float32)
    labels = digits.target.astype(np.int64)
    mnist_train = torch.utils.data.TensorDataset(torch.as_tensor(images[:1500]), torch.as_tensor(labels[:1500]))
    mnist_test = torch.utils.data.TensorDataset(torch.as_tensor(images[1500:]), torch.as_tensor(labels[1500:]))

    BATCH_SIZE_PER_REPLICA = 64
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

    train_dataset = torch.utils.data.DataLoader(mnist_train, batch_size=BATCH_SIZE, shuffle=True)
    eval_dataset = torch.utils.data.DataLoader(mnist_test, batch_size=BATCH_SIZE)

    return train_dataset, eval_dataset


def get_model():
    with mirrored_strategy.scope():
        model = keras.Sequential(
            [
                keras.layers.Conv2D(32, 3, activation="relu", input_shape=(8, 8, 1)),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )

        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.Adam(),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
        return model


model = get_model()
train_dataset, eval_dataset = get_data()
history = model.fit(train_dataset, epochs=2)
trained_model = model  # (added) checked at the end

# (added) the inputs every load is checked on, and what the saved model predicts for them
x_check = next(iter(eval_dataset))[0].numpy()


def same_predictions(loaded_predictions, reference, what):
    loaded_predictions = np.asarray(keras.ops.convert_to_numpy(loaded_predictions))
    np.testing.assert_allclose(loaded_predictions, reference, rtol=1e-5, atol=1e-5, err_msg=what)


saved_predictions = model.predict(x_check, verbose=0)

# ---- The Keras APIs
keras_model_path = "keras_save.keras"
model.save(keras_model_path)

restored_keras_model = keras.models.load_model(keras_model_path)
same_predictions(restored_keras_model.predict(x_check, verbose=0), saved_predictions, "load_model, no strategy")
restored_keras_model.fit(train_dataset, epochs=2)

another_strategy = phalanx.OneDeviceStrategy("/cpu:0")
with another_strategy.scope():
    restored_keras_model_ds = keras.models.load_model(keras_model_path)
    same_predictions(restored_keras_model_ds.predict(x_check, verbose=0), saved_predictions, "load_model, OneDevice")
    restored_keras_model_ds.fit(train_dataset, epochs=2)

# ---- The low-level APIs (tf.saved_model -> torch.export through Keras' export)
# (added) Keras' export(format="torch") came with Keras 3.15; phalanx allows Keras from 3.6, where
# this section has no counterpart and is left out (the tutorial says so).
if tuple(int(p) for p in keras.__version__.split(".")[:2]) >= (3, 15):
    model = get_model()  # get a fresh model
    fresh_predictions = model.predict(x_check, verbose=0)
    saved_model_path = "tf_save.pt2"
    model.export(saved_model_path, format="torch", dynamic_shapes={0: torch.export.Dim("batch")})

    loaded = torch.export.load(saved_model_path)
    inference_func = loaded.module()

    predict_dataset = [image for image, label in eval_dataset]
    for batch in predict_dataset[:1]:
        print(inference_func(batch).shape)
        same_predictions(inference_func(batch).detach(), fresh_predictions, "torch.export.load, no strategy")

    another_strategy = phalanx.MirroredStrategy()
    with another_strategy.scope():
        loaded = torch.export.load(saved_model_path)
        inference_func = loaded.module()

        dist_predict_dataset = another_strategy.experimental_distribute_dataset(predict_dataset)

        # Calling the function in a distributed manner
        results = []
        for batch in dist_predict_dataset:
            results.append(another_strategy.run(inference_func, args=(batch,)))
    # (added) the replicas' rows of the first batch, gathered, are the whole batch's predictions
    first = another_strategy.gather(results[0], axis=0)
    same_predictions(first.detach(), fresh_predictions, "torch.export.load, distributed inference")
else:
    print(f"Keras {keras.__version__} has no model.export(format='torch') (3.15 added it): low-level section left out")


# The section that wraps the loaded object in hub.KerasLayer(loaded, trainable=True) to train it
# further is left out: tensorflow_hub has no torch counterpart, and Keras' TorchModuleWrapper
# cannot wrap a torch.export program's module (it switches the module to eval mode, which
# torch.export's modules refuse: "Calling train() is not supported yet").

# ---- Which API should I use? (mixing: Keras save, then load)
model = get_model()

# Saving the model using Keras's save() API
model.save(keras_model_path)
mixed_predictions = model.predict(x_check, verbose=0)

another_strategy = phalanx.MirroredStrategy()
# Loading the model (a .keras file is loaded with the Keras API)
with another_strategy.scope():
    loaded = keras.models.load_model(keras_model_path)
same_predictions(loaded.predict(x_check, verbose=0), mixed_predictions, "Keras save, load under another strategy")

# ---- Saving/Loading from local device
model = get_model()

# Saving the model to a path on localhost.
saved_model_path = "tf_save.keras"
model.save(saved_model_path)
local_predictions = model.predict(x_check, verbose=0)

# Loading the model from a path on localhost.
another_strategy = phalanx.MirroredStrategy()
with another_strategy.scope():
    loaded = keras.models.load_model(saved_model_path)
same_predictions(loaded.predict(x_check, verbose=0), local_predictions, "local device save and load")


# ---- Caveats
class SubclassedModel(keras.Model):
    output_name = "output_layer"

    def __init__(self):
        super().__init__()
        self._dense_layer = keras.layers.Dense(5, dtype="float32", name=self.output_name)

    def call(self, inputs):
        return self._dense_layer(inputs)


my_model = SubclassedModel()
# my_model.save(keras_model_path)  # ERROR!
x_flat = x_check.reshape(len(x_check), -1)
subclassed_predictions = keras.ops.convert_to_numpy(my_model(x_flat))  # (added) builds it, to compare
saved_model_path = "tf_save_subclassed"
phalanx.checkpoint.Checkpoint(model=my_model).write(saved_model_path)
# (added) load: a fresh copy, restored when its first call builds it
fresh_model = SubclassedModel()
phalanx.checkpoint.Checkpoint(model=fresh_model).restore(saved_model_path)
same_predictions(fresh_model(x_flat), subclassed_predictions, "Checkpoint of a subclassed model")

# ---- checks (not in the tutorial): it trained correctly, and the replicas agree
losses = history.history["loss"]
assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
checksum = float(sum(np.abs(w).sum() for w in trained_model.get_weights()))
everyone = mirrored_strategy.gather(
    mirrored_strategy.run(lambda: torch.tensor([checksum], dtype=torch.float64)), axis=0
)
assert len(set(everyone.tolist())) == 1, f"replicas differ: {everyone.tolist()}"
print("TUTORIAL OK")
