"""TF 2.0's ``tf.distribute.experimental`` names, for code written against them."""

from phalanx.input.context import InputOptions as InputOptions  # noqa: F401
from phalanx.values import ReduceOp as ReduceOp  # noqa: F401
