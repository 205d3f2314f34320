"""Pure maths (no TensorFlow): metric reductions, fingerprints, the slow worker, verify's comparison."""
