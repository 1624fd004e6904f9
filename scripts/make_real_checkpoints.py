"""Write the real-weight test checkpoints in tests/data/real/ (run once, by hand, in a tool virtualenv).

The tiny fixtures in ../shared/fixtures have random weights; trained weights have
outlier channels and massive activations that random ones lack.  These
checkpoints are the default model's own trained weights (SmolLM2-135M-Instruct,
dequantized from its GGUF by transformers), cut to fit in the repository, then
quantized by llm-compressor, each with transformers' own forward beside it.

Cut: the first LAYERS decoder layers and the first VOCAB rows of the (tied)
embedding.  Every weight that remains is the trained one; the prompts below use
only token ids < VOCAB.  Recipes (llm-compressor's own examples, data-free or on
CALIB docstrings from the Python standard library, no download):

* ``w8a8``      QuantizationModifier scheme W8A8: int8 per-channel weights,
                int8 dynamic per-token activations (compressed-tensors int-quantized).
* ``awq-w4a16`` AWQModifier, int4 asymmetric (zero point), group 64 (576 is not a multiple of 128): AWQ folds its
                activation scales into the RMSNorm weights, so a few input
                channels of every linear are far larger than the rest.

Beside each checkpoint, ``reference.safetensors`` holds, for prompt i:
``ids{i}`` int64 [T], ``logprobs{i}`` float32 [T, VOCAB] (transformers +
compressed-tensors, float32, eager attention: the tool's forward, which for
W8A8 quantize-dequantizes every Linear input per token), ``logprobs_sdpa{i}``
(the same with SDPA attention: how far the tool is from itself) and
``greedy{i}`` int64 [16] (greedy continuation, eager).

Tool virtualenv (never quill's own)::

    python3 -m venv /tmp/toolvenv && /tmp/toolvenv/bin/pip install torch==2.13.0
    /tmp/toolvenv/bin/pip install llmcompressor==0.14.0.1 compressed-tensors==0.19.0 \\
        transformers==5.17.0 gguf datasets
    /tmp/toolvenv/bin/python scripts/make_real_checkpoints.py path/to/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/real
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

LAYERS = 2
VOCAB = 4096
PROMPTS = ["The capital of the United States is", "I think that the best way to learn is",
           "The first thing you need to do is", "In the beginning of the year, the", "def main():\n    return"]
CALIB_MODULES = ["json", "os", "re", "collections", "functools", "itertools", "pathlib", "typing", "argparse",
                 "logging", "subprocess", "random", "string", "textwrap", "csv", "datetime", "decimal"]
GREEDY = 16


def cut_model(gguf: Path, out: Path):
    """The GGUF's weights as a bf16 transformers checkpoint of LAYERS layers and VOCAB tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    full = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    cfg = full.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.update(num_hidden_layers=LAYERS, vocab_size=VOCAB)
    config = type(full.config).from_dict(cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v for k, v in full.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < LAYERS}
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:VOCAB].clone()
    state.pop("lm_head.weight", None)  # tied
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"cut model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out)
    return tok


def calibration(tok, vocab: int | None = VOCAB):
    """Up to 64 standard-library docstrings of 256 tokens (ids below ``vocab`` when given: the cut model)."""
    from datasets import Dataset
    texts = set()
    for name in CALIB_MODULES:
        mod = importlib.import_module(name)
        for obj in [mod] + [getattr(mod, a) for a in dir(mod) if not a.startswith("_")]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200:
                texts.add(doc)
    rows = []
    for text in sorted(texts)[:64]:
        ids = [t for t in tok(text).input_ids if vocab is None or t < vocab][:256]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    return Dataset.from_list(rows)


def recipes():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    return {
        "w8a8": [QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])],
        "awq-w4a16": [AWQModifier(ignore=["lm_head"], config_groups={"group_0": QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                                                         group_size=64))})],
    }


def quantize(src: Path, out: Path, recipe, data, tok) -> None:
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM
    # llm-compressor 0.14's sequential pipeline (AWQ) pins cached activations for faster copies to an
    # accelerator, which raises on a CPU-only torch; pinning changes no value, so skip it.
    IntermediatesCache._pin_intermediate = classmethod(lambda cls, intermediate: None)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    oneshot(model=model, processor=tok, dataset=data, recipe=recipe, max_seq_length=256,
            num_calibration_samples=len(data))
    model.save_pretrained(out, save_compressed=True)
    for name in ("recipe.yaml",):
        if not (out / name).exists():
            raise RuntimeError(f"llm-compressor wrote no {name} in {out}")


def reference(ckpt: Path, tok) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    result: dict[str, torch.Tensor] = {}
    for attn in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation=attn).eval()
        with torch.no_grad():
            for i, prompt in enumerate(PROMPTS):
                ids = torch.tensor([tok(prompt).input_ids])
                if int(ids.max()) >= VOCAB:
                    raise RuntimeError(f"prompt {prompt!r} has token ids >= {VOCAB}")
                logprobs = torch.log_softmax(model(ids).logits[0].float(), -1).contiguous()
                if attn == "eager":
                    result[f"ids{i}"] = ids[0]
                    result[f"logprobs{i}"] = logprobs
                    out = model.generate(ids, max_new_tokens=GREEDY, do_sample=False, min_new_tokens=GREEDY)
                    result[f"greedy{i}"] = out[0, ids.shape[1]:].contiguous()
                else:
                    result[f"logprobs_sdpa{i}"] = logprobs
    return result


def main(gguf: str, dest: str) -> None:
    from safetensors.torch import save_file
    dest_dir = Path(dest)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "cut-bf16"
        tok = cut_model(Path(gguf), src)
        data = calibration(tok)
        for name, recipe in recipes().items():
            out = dest_dir / name
            shutil.rmtree(out, ignore_errors=True)
            quantize(src, out, recipe, data, tok)
            save_file(reference(out, tok), str(out / "reference.safetensors"))
            (out / "PROMPTS.json").write_text(json.dumps(PROMPTS, indent=1) + "\n")
            print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
