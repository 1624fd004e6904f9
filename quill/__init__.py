"""quill: a CPU-first inference engine for quantized LLM checkpoints.

    import quill
    llm = quill.LLM("path/to/checkpoint")      # a directory, a .gguf file, a Hub id, or None
    out = llm.generate("The capital of France is", quill.SamplingParams(temperature=0, max_tokens=8))
    print(out[0].text)
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]


def __getattr__(name: str):
    # Imported on first use so `import quill` (and the CLI's start-up) does not load torch.
    if name == "LLM":
        from quill.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from quill.engine.sampling import SamplingParams
        return SamplingParams
    if name == "StructuredOutputs":
        from quill.engine.structured import StructuredOutputs
        return StructuredOutputs
    raise AttributeError(f"module 'quill' has no attribute {name!r}")
