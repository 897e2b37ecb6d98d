"""The toy example of the seeds (``seeds/002``), distributed with phalanx; only the imports changed.

Random 10-feature binary data through a dataset of batches of 256, ``Dense(16, relu) ->
Dense(1, sigmoid)``, ``SGD(0.2)``, ``binary_crossentropy``, ``model.summary()`` and
``fit(dataset, epochs=5, steps_per_epoch=10)``. What differs from the seed:

* imports: ``tensorflow`` is gone; ``tf.keras`` / ``keras`` is Keras 3 on the torch backend and
  ``tf.distribute`` is ``phalanx``;
* the strategy line takes its strategy from ``--strategy`` (see ``strategy_flag.py``);
* ``tf.data`` is torch's: ``tf.dtypes.cast`` is ``torch.as_tensor(..., dtype=torch.float32)`` and
  ``from_tensor_slices(...).shuffle(N).batch(256)`` is a shuffling ``DataLoader`` of batch 256;
* the seed's ``optimizer = ...`` line, dedented out of the ``with`` block by the book's
  typesetting, is inside it.

As in the seed each global batch of 256 is split across the replicas (128 each with two). Every
process runs the script, so each draws its own random data, as each TF worker would.

Why two replicas are slower here than one: this model is tiny, so a step computes in well under a
millisecond and one process already keeps a core busy. Two replicas halve that compute but add a
gradient all-reduce and a step-end agreement every step, and on a 2-core machine the two
processes also share the cores with Keras' own work. Data parallelism pays off when a step
computes for much longer than it communicates (bigger models and batches, or one GPU per
replica); this example shows that the code runs unchanged, not a speed-up.

Run::

    python examples/keras_toy.py --strategy mirrored     # 2 CPU replicas (or every GPU)
    python examples/keras_toy.py --strategy one_device
    TF_CONFIG=... python examples/keras_toy.py --strategy multi_worker
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402  (from tensorflow import keras)
import numpy as np  # noqa: E402
import torch  # noqa: E402  (tf.data, tf.dtypes)
from strategy_flag import strategy_from_flags  # noqa: E402

N_TRAIN_EXAMPLES = 1024 * 1024
N_FEATURES = 10
SIZE_BATCHES = 256

# 10 random floats in the half-open interval [0.0, 1.0).
x = np.random.random((N_TRAIN_EXAMPLES, N_FEATURES))
y = np.random.randint(2, size=(N_TRAIN_EXAMPLES, 1))
x = torch.as_tensor(x, dtype=torch.float32)
print(x)
dataset = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(x, torch.as_tensor(y)), batch_size=SIZE_BATCHES, shuffle=True
)

# this is the distribution strategy
distribution = strategy_from_flags(__doc__)

# this piece of code is distributed to multiple GPUs
with distribution.scope():
    model = keras.Sequential()
    model.add(keras.layers.Dense(16, activation="relu", input_shape=(N_FEATURES,)))
    model.add(keras.layers.Dense(1, activation="sigmoid"))
    optimizer = keras.optimizers.SGD(0.2)
    model.compile(loss="binary_crossentropy", optimizer=optimizer)

model.summary()

# Optimize in the usual way but in reality you are using GPUs.
model.fit(dataset, epochs=5, steps_per_epoch=10)
