"""Checkpoint formats -> the canonical weight (quill.canonical).

Nothing is imported here, so a kernel or a tool that needs one reader loads no other:
``quill.formats.checkpoint`` opens checkpoints (safetensors directories, GGUF files),
``quill.formats.registry`` maps quant_method to a reader, ``gguf`` and
``compressed_tensors`` hold those formats.
"""
