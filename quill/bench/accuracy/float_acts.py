"""What a cheaper float-activation path would cost in accuracy (issue 40, item 3).

    .venv/bin/python -m quill.bench.accuracy.float_acts [--tokens 8192] [--json docs/bench/accuracy/float-acts.json]
        [--variants native16 ...]  (only these rows, merged into an existing --json)

quill's float-activation kernels (W4A16, W8A16) in their exact mode (``activation_quant="exact"``)
multiply a 24-bit fixed-point image of each input segment (amax / 8355711 per token and segment of
<= 128 columns, split in three int8 parts), exact to float32 rounding.  Two parts (a 16-bit image)
or bf16 / fp16 activations are cheaper.  This scores each against the native 24-bit path on the
real-weight checkpoints of the tests that run float activations:

* the default model (SmolLM2-135M-Instruct Q4_1 GGUF, all 30 layers), and
* tests/data/real/awq-w4a16 (the same weights, 2 layers, quantized by llm-compressor's AWQ: the
  activation scales folded into the RMSNorm weights put a few input channels far above the rest).

The cheaper images are emulated exactly: the reference kernel (float32 weights dequantized once,
float32 matmul) fed inputs rounded to the image (per token and segment, round half to even, as the
native quantizer rounds) or cast to bf16 / fp16.  Two controls: ``exact`` (float32 inputs) and
``image24`` (the native image, emulated) must sit near zero KL against the native kernel, or the
emulation itself would be in doubt.  ``native16`` is the native kernel's own 16-bit image (built after
this study: ``activation_quant="none"``, the float default).  Text: pydoc_data.topics (every CPython
has it), tokenized by the default model's tokenizer; the AWQ cut keeps the first 4096 ids of that
vocabulary, so its text is the same tokens with the others dropped.  Numbers: mean KL (top-128 of the
base, the rest one outcome), top-1 agreement; targets of the issue: mean KL <= 1e-5 and top-1 >= 99.9 %.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import quill
from quill.kernels.reference import ReferenceKernel, ReferenceState
from quill.kernels.selection import KERNELS

AWQ_CUT = Path(__file__).resolve().parents[3] / "tests" / "data" / "real" / "awq-w4a16"
MAX_SEGMENT = 128  # the native float kernels' longest segment (csrc/common.h SPLIT_MAX_SEGMENT)
IMAGE_QMAX = {"image24": 8355711.0, "image16": 32767.0}  # the largest |q| of each image
VARIANTS = ("exact", "image24", "image16", "bf16", "fp16")  # emulated through the reference kernel
NATIVE = ("native16",)  # the native kernel's 16-bit image


def round_input(x: torch.Tensor, variant: str, segment: int) -> torch.Tensor:
    """x float32 [M, K] as the variant's kernel would see it."""
    if variant == "exact":
        return x
    if variant in ("bf16", "fp16"):
        return x.to(torch.bfloat16 if variant == "bf16" else torch.float16).float()
    m, k = x.shape
    pad = -k % segment
    xs = torch.nn.functional.pad(x, (0, pad)).view(m, -1, segment)  # [M, S, segment]
    scale = xs.abs().amax(-1, keepdim=True) / IMAGE_QMAX[variant]
    q = torch.where(scale > 0, torch.round(xs / scale), torch.zeros_like(xs))
    return (q * scale).view(m, -1)[:, :k]


class _RoundedReference(ReferenceKernel):
    """The reference kernel fed rounded inputs (float activations only)."""

    variant = "exact"

    @classmethod
    def prepare(cls, weight, cfg) -> ReferenceState:
        state = super().prepare(weight, cfg)
        state.segment = min(weight.group_size, MAX_SEGMENT)
        return state

    @classmethod
    def apply(cls, state, x, bias=None):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = round_input(x.reshape(-1, k).float(), cls.variant, state.segment)  # [M, K]
        return super().apply(state, x2.reshape(*lead, k).to(x.dtype), bias)


def _register() -> None:
    """One kernel per variant, forced by name (this process only)."""
    for v in VARIANTS:
        globals()[f"Ref_{v}"] = type(f"Ref_{v}", (_RoundedReference,), {"variant": v, "name": f"ref_{v}"})
        KERNELS[f"ref_{v}"] = f"{__name__}:Ref_{v}"


def text_tokens(n: int, vocab: int | None) -> list[int]:
    from pydoc_data.topics import topics

    from quill.default_model import default_model_path
    from quill.formats.checkpoint import open_checkpoint
    from quill.tokenizer import Tokenizer
    tok = Tokenizer(open_checkpoint(default_model_path()).tokenizer_spec())  # the tokenizer only, no weights
    ids = tok.encode("\n\n".join(topics[k] for k in sorted(topics)))
    if vocab is not None:
        ids = [i for i in ids if i < vocab]
    return ids[:n]


def study(model: str, tokens: list[int], context: int, log, own_tokenizer: bool = True,
          variants: tuple[str, ...] = VARIANTS + NATIVE) -> dict:
    from quill.eval.compare import compare, score_base
    opts = dict(kv_cache_dtype="float32", max_model_len=context, cache=False, skip_tokenizer_init=not own_tokenizer)

    def load(v=None):
        if v is None:
            return quill.LLM(model, activation_quant="exact", **opts)
        if v in NATIVE:
            return quill.LLM(model, activation_quant="none", **opts)
        return quill.LLM(model, activation_quant="none", kernel=f"ref_{v}", **opts)

    base = score_base(load(), tokens, context, context // 2, 128, "native 24-bit image")
    rows = {}
    for v in variants:
        t = time.perf_counter()
        r = compare(base, load(v), tokens, v).as_dict()
        rows[v] = {"kl_mean": r["kl_mean"], "kl_p99": r["kl_p99"], "kl_max": r["kl_max"],
                   "top1_agreement": r["top1_agreement"], "tokens": r["tokens_evaluated"]}
        log(f"  {v:<8} mean KL {r['kl_mean']:.3e}  p99 {r['kl_p99']:.3e}  max {r['kl_max']:.3e}  "
            f"top-1 {100 * r['top1_agreement']:.3f} %  ({time.perf_counter() - t:.0f} s)")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens of text scored per checkpoint")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--variants", nargs="+", choices=VARIANTS + NATIVE, default=None,
                   help="only these rows, merged into an existing --json (default: all, a new file)")
    args = p.parse_args(argv)
    variants = tuple(args.variants or VARIANTS + NATIVE)
    _register()
    from quill.default_model import default_model_path
    from quill.platform import detect
    out = {"cpu": detect().summary(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "base": "native float-activation kernel (24-bit image), float32 model and KV cache",
           "targets": {"kl_mean_max": 1e-5, "top1_min": 0.999}, "checkpoints": {}}
    for name, model, vocab in (("default model (Q4_1 GGUF)", str(default_model_path()), None),
                               ("AWQ-folded 2-layer cut (llm-compressor)", str(AWQ_CUT), 4096)):
        print(f"{name}:", flush=True)
        out["checkpoints"][name] = study(model, text_tokens(args.tokens, vocab), args.context,
                                         lambda s: print(s, flush=True), own_tokenizer=vocab is None,
                                         variants=variants)
    if args.json and args.variants and args.json.exists():  # the new rows into the earlier run's file
        old = json.loads(args.json.read_text())
        for name, rows in out["checkpoints"].items():
            old["checkpoints"].setdefault(name, {}).update(rows)
        old.setdefault("updates", []).append({"variants": list(variants), "cpu": out["cpu"], "date": out["date"]})
        out = old
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
