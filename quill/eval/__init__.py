"""Accuracy the way quantization users measure it: perplexity and KL divergence against a base.

``quill.eval.perplexity`` (strided windows over one tokenized text) and ``quill.eval.compare``
(per-token KL, top-1 agreement, PPL ratio) run on ``LLM.score``; ``quill eval`` is their CLI.
"""
