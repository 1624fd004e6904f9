"""Accuracy of every format and precision against a base, and against llama.cpp (docs/ACCURACY.md).

``run.sh`` reproduces the figures: ``models`` writes the checkpoints, ``tool_models`` (in
llm-compressor's own virtualenv) the tool-quantized ones, ``quill eval compare`` scores them,
``table`` renders the JSON, ``llamacpp`` compares the engines' arithmetic on one GGUF file.
"""
