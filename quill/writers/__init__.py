"""Writers of quantized checkpoints and weights (tests, benchmarks): never imported by the readers."""
