"""phalanx's own tf.distribute conformance suite: cases translated from TensorFlow's tests (see README.md)."""
