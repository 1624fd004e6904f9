"""GGUF files (llama.cpp): the container, the block quants, the architecture map, the tokenizer."""
