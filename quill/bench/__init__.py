"""Benchmarks: kernels (quill bench kernels) and the model-level checkpoint."""
