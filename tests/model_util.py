"""Tiny random models for tests: transformers twins, on-disk HF directories, synthetic quantized checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quill.canonical import QuantizedWeight
from quill.writers.rtn import quantize_rtn

VOCAB = 320
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, pad_token_id=3)
ARCH_EXTRA = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=True, head_dim=32),  # head_dim != hidden / heads (16)
    "mistral": dict(tie_word_embeddings=False, sliding_window=64),  # window < max positions: context capped
}


def hf_model(model_type: str, seed: int = 0, **overrides):
    """A random float32 transformers model of ``model_type`` (eager attention: the reference)."""
    import transformers
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[model_type]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM}[model_type]
    cfg = cfg_cls(**{**BASE, **ARCH_EXTRA[model_type], **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:  # norms and biases away from their 1 / 0 init, so they are exercised
                p.add_(torch.randn_like(p) * 0.05)
    return model


def byte_tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences (multi-byte characters stay split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the capital of france is paris. hello world, what is the answer? " * 4,
            "the quick brown fox jumps over the lazy dog " * 3]
    tok.train_from_iterator(text, trainer)
    return tok


def save_hf_dir(model, directory: Path, tokenizer: bool = True, dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` as an HF checkpoint directory (safetensors), optionally with tokenizer files."""
    directory = Path(directory)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory)
    if tokenizer:
        byte_tokenizer().save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>",
            "add_bos_token": False, "chat_template": CHATML}))
    return directory


class MemoryCheckpoint:
    """The Checkpoint interface over tensors in memory: a stand-in *data source* for loader tests.

    ``quantize`` maps module names to quantize_rtn keyword arguments; those
    modules are served as QuantizedWeight, everything else as dense tensors.
    ``reference_state()`` is the float state dict a transformers twin should load.
    """

    def __init__(self, config: dict, state: dict[str, torch.Tensor], quantize: dict[str, dict]):
        self.config = config
        self.path = Path("<memory>")
        self.dense: dict[str, torch.Tensor] = {}
        self.layers: dict[str, QuantizedWeight] = {}
        gen = torch.Generator().manual_seed(0)
        for name, t in state.items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in quantize:
                qw = quantize_rtn(t.float(), generator=gen, **quantize[module])
                qw = qw.with_(name=module)
                bias = state.get(f"{module}.bias")
                self.layers[module] = qw.with_(bias=bias) if bias is not None else qw
            elif not (name.endswith(".bias") and name.removesuffix(".bias") in quantize):
                self.dense[name] = t

    def quantized_layers(self):
        yield from self.layers.items()

    def dense_tensors(self):
        yield from self.dense.items()

    def describe(self) -> str:
        return "in-memory test checkpoint (quantize_rtn)"

    def reference_state(self) -> dict[str, torch.Tensor]:
        state = dict(self.dense)
        for module, qw in self.layers.items():
            state[f"{module}.weight"] = qw.dequantize()
            if qw.bias is not None:
                state[f"{module}.bias"] = qw.bias
        return state


def linear_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
