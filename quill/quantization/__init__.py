"""Checkpoints (safetensors directories, GGUF files) and their formats -> the canonical weight.

Nothing is imported here: ``quill.quantization.checkpoint`` opens checkpoints, the
format readers live in ``quill.quantization.formats``.
"""
