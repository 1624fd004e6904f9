"""Benchmarks: kernels (quill bench kernels) and the model-level checkpoint."""


def settled(llm):
    """``llm`` once its load's background work is done: a prepacked-cache miss writes the cache file on a
    thread, and a timing taken beside that write measures the writer too (a fresh MoE checkpoint's first
    decode ran at a fifth of its speed while 1.2 GB were written)."""
    if llm.cache is not None:
        llm.cache.wait()
    return llm
