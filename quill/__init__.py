"""quill: a CPU-first inference engine for quantized LLM checkpoints."""

__version__ = "0.1.0"
