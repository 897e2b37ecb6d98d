"""The seed notebook's MLP (``seeds/004``), distributed with phalanx; only the imports changed.

The notebook builds ``Dense(128, relu) -> Dropout(0.2) -> Dense(10, softmax)`` (Adam, sparse
categorical cross-entropy), once normally and once inside ``MirroredStrategy.scope()``, and times
``fit(X_train, y_train, epochs=10, batch_size=25)`` of both. What differs from the notebook:

* imports: ``tensorflow`` is gone; ``tf.keras`` is ``keras`` (torch backend) and ``tf.distribute``
  is ``phalanx``, as phalanx's naming promises;
* the strategy line takes its strategy from ``--strategy`` (see ``strategy_flag.py``);
* ``tf.keras.datasets.mnist.load_data()`` (a download) is replaced by scikit-learn's bundled 8x8
  digits, upscaled to MNIST's format (28x28 uint8), so every later line, 784 inputs included, is
  the notebook's;
* the notebook's ``y_train = y_train/255.0`` is left out: it turns every label into 0.

``batch_size=25`` is the global batch: with two replicas each computes on 12 or 13 rows per step.

Why two replicas are slower here than one: this model is tiny, so a step computes in well under a
millisecond and one process already keeps a core busy. Two replicas halve that compute but add a
gradient all-reduce and a step-end agreement every step, and on a 2-core machine the two
processes also share the cores with Keras' own work. Data parallelism pays off when a step
computes for much longer than it communicates (bigger models and batches, or one GPU per
replica); this example shows that the code runs unchanged, not a speed-up.

Run::

    python examples/keras_mnist_mlp.py --strategy mirrored     # 2 CPU replicas (or every GPU)
    python examples/keras_mnist_mlp.py --strategy one_device
    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}' \\
        python examples/keras_mnist_mlp.py --strategy multi_worker      # on each worker, its own index
"""

import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402  (tf.keras)
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402  (instead of the MNIST download)
from strategy_flag import strategy_from_flags  # noqa: E402


def load_data():
    """The bundled digits as MNIST's ``load_data()`` returns them: 28x28 uint8 images, int labels."""
    digits = load_digits()
    images = np.kron(digits.images, np.ones((3, 3)))  # 8x8 -> 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))) * (255.0 / 16.0)  # -> 28x28, 0..255
    images, labels = images.astype(np.uint8), digits.target.astype(np.uint8)
    return (images[:1500], labels[:1500]), (images[1500:], labels[1500:])


# DATASET PREPROCESSING
(X_train, y_train), (X_test, y_test) = load_data()
X_train = X_train / 255.0
print(X_train.shape)
X_train = X_train.reshape(-1, 28 * 28)
X_test = X_test.reshape(-1, 28 * 28)

# DEFINING A NON DISTIBUTED MODEL (NORMAL MODEL)
model_normal = keras.Sequential()
model_normal.add(keras.layers.Dense(units=128, activation="relu", input_shape=(784,)))
model_normal.add(keras.layers.Dropout(rate=0.2))
model_normal.add(keras.layers.Dense(units=10, activation="softmax"))
model_normal.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"])

# DISTRIBUTED MODEL
distribute = strategy_from_flags(__doc__)
with distribute.scope():
    model_dis = keras.Sequential()
    model_dis.add(keras.layers.Dense(units=128, activation="relu", input_shape=(784,)))
    model_dis.add(keras.layers.Dropout(rate=0.2))
    model_dis.add(keras.layers.Dense(units=10, activation="softmax"))
    model_dis.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"])

# SPEED TEST - NORMAL VS DISTRIBUTED MODEL
start_time = time.time()
model_dis.fit(X_train, y_train, epochs=10, batch_size=25)
print(f"Time taken by distributed training : {time.time() - start_time}")

start_time = time.time()
model_normal.fit(X_train, y_train, epochs=10, batch_size=25)
print(f"Time taken by normal training : {time.time() - start_time}")
