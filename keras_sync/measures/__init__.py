"""The pure maths of the sync metrics (no TensorFlow): reductions, fingerprints, the slow worker."""
