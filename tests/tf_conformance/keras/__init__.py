"""The Keras suite of the conformance tests: tf_keras/distribute's tests, translated (see README.md)."""
