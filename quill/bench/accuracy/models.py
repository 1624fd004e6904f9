"""Write the checkpoints docs/ACCURACY.md compares: the default model's weights as a bf16 base, and 4-bit copies.

    .venv/bin/python -m quill.bench.accuracy.models OUT_DIR [--llama-python .venv-llamacpp/bin/python]

* ``base-bf16``: SmolLM2-135M-Instruct as the default model's GGUF holds it (Q4_1), dequantized by
  transformers into a plain bf16 checkpoint, with the tokenizer quill builds from the GGUF.  No
  unquantized original ships in a package; this is the nearest real base every machine has.
* ``gptq-w4g64``, ``awq-w4g64``, ``ct-w4a16-g64``, ``ct-w8a16``: every Linear of the base quantized
  with round-to-nearest (quill.writers.rtn) and written in each format's layout by quill's writers
  (GPTQ v1 symmetric, AWQ GEMM asymmetric with zero points, compressed-tensors pack-quantized
  symmetric, compressed-tensors int8 per channel).  Group 64: 576 is not a multiple of 128.
  RTN, not GPTQ's or AWQ's own algorithms (their tools need calibration runs this script does
  not make): the figures show what each layout and scheme costs, not what each tool's search
  recovers.  lm_head stays tied to the bf16 embedding, as in the GGUF.
* ``q4_0.gguf``, ``q8_0.gguf`` (with ``--llama-python``): the default GGUF requantized by llama.cpp's
  own quantizer (``llama_model_quantize``, allow_requantize) in a separate virtualenv.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quill.bench.llamacpp import quantize_with_llamacpp
from quill.default_model import default_model_path
from quill.writers.awq import canonical_to_awq
from quill.writers.compressed_tensors import quantization_config, scheme_config, to_compressed_tensors
from quill.writers.gptq import canonical_to_gptq
from quill.writers.rtn import quantize_rtn

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 64


def write_base(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    full = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    cfg = full.config.to_dict()
    cfg.pop("quantization_config", None)  # a GGUF-loaded model will not save; a plain copy of its weights will
    model = AutoModelForCausalLM.from_config(type(full.config).from_dict(cfg), dtype=torch.bfloat16)
    state = {k: v for k, v in full.state_dict().items() if k != "lm_head.weight"}  # tied
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"base model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # transformers' GGUF-to-tokenizers conversion splits some whitespace runs differently from
    # llama.cpp ("\n   " in pydoc_data.topics: 113108 tokens against llama.cpp's 112955); the
    # tokenizer quill builds from the GGUF matches llama.cpp, so the base carries that one and
    # every model compared sees the same tokens.
    from quill.formats.checkpoint import open_checkpoint
    open_checkpoint(gguf).tokenizer_spec().tokenizer.save(str(out / "tokenizer.json"))


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def write_quantized(base: Path, out: Path, writer, quant: dict | None, fmt: str = "pack-quantized", **rtn) -> None:
    """Every Linear of ``base`` RTN-quantized and written by ``writer``; everything else copied."""
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(base / "model.safetensors"))
    tensors, scheme = {}, None
    for name, t in state.items():
        if not is_linear(name):
            tensors[name] = t
            continue
        module = name.removesuffix(".weight")
        qw = quantize_rtn(t.float(), group_size=rtn.get("group_size", GROUP), bits=rtn.get("bits", 4),
                          symmetric=rtn.get("symmetric", True)).with_(name=module)
        scheme = scheme or scheme_config(qw, fmt)
        tensors.update({f"{module}.{k}": v for k, v in writer(qw).items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = quant if quant is not None else quantization_config({"group_0": scheme})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, out / f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--llama-python", default=None, help="a python with llama-cpp-python (for the GGUF requants)")
    args = ap.parse_args()
    gguf = default_model_path()
    base = args.out / "base-bf16"
    if not (base / "model.safetensors").exists():
        write_base(gguf, base)
    write_quantized(base, args.out / "gptq-w4g64", lambda q: canonical_to_gptq(q, v1=True, write_g_idx=False),
                    {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False})
    write_quantized(base, args.out / "awq-w4g64", canonical_to_awq,
                    {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
                    symmetric=False)
    write_quantized(base, args.out / "ct-w4a16-g64", to_compressed_tensors, None)
    write_quantized(base, args.out / "ct-w8a16", lambda q: to_compressed_tensors(q, fmt="int-quantized"), None,
                    fmt="int-quantized", bits=8, group_size=-1)
    if args.llama_python:
        for ftype in ("Q4_0", "Q8_0"):
            quantize_with_llamacpp(args.llama_python, gguf, args.out / f"{ftype.lower()}.gguf", ftype)


if __name__ == "__main__":
    main()
