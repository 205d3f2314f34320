"""Private Keras, TensorFlow and MLflow internals behind probes, and the fixes that use them."""
