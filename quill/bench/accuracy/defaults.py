"""What quill's defaults cost against float (docs/ACCURACY.md, "The defaults against float").

    .venv/bin/python quill/bench/accuracy/defaults.py [--tokens 4096] [--json FILE]

For the default model (GGUF Q4_1) and each real-weight HF checkpoint of tests/data/real, the base
is float arithmetic (``activation_quant="none"``, ``kv_cache_dtype="float32"``) and each OTHER a
default: both defaults (``LLM(path)``), the activation default alone, the float16 KV cache alone.
Text: pydoc_data.topics tokenized by the default model's tokenizer; the real checkpoints (2 layers,
a 4096-token vocabulary, no tokenizer files) get the same token stream with ids >= 4096 dropped.
Windows of 512 tokens every 256, KL over the base's top 128 + rest (``quill eval compare``'s way).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import quill
from quill.default_model import default_model_path
from quill.eval.compare import compare, score_base

REAL = Path(__file__).resolve().parents[3] / "tests" / "data" / "real"
FLOAT = {"activation_quant": "none", "kv_cache_dtype": "float32"}
OTHERS = {"both defaults": {}, "activations default, float32 KV": {"kv_cache_dtype": "float32"},
          "float activations, float16 KV": {"activation_quant": "none"}}
CONTEXT, STRIDE, TOP_K = 512, 256, 128


def text_tokens(n: int) -> list[int]:
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return quill.LLM(default_model_path(), progress=False).tokenizer.encode(text)[:n]


def rows_for(path: str, tokens: list[int], threads: int | None = None) -> list[dict]:
    def load(**kw):
        return quill.LLM(path, skip_tokenizer_init=True, progress=False, max_model_len=CONTEXT, threads=threads, **kw)
    base_llm = load(**FLOAT)
    base = score_base(base_llm, tokens, CONTEXT, STRIDE, TOP_K, f"{path} float")
    rows = []
    for name, kw in OTHERS.items():
        llm = load(**kw)
        result = compare(base, llm, tokens, name).as_dict()
        rows.append({"model": path, "other": name, **llm.arithmetic, **result})
        print(f"{Path(path).name:<34} {name:<32} KL {result['kl_mean']:.5f} +/- {result['kl_stderr']:.5f}  "
              f"top-1 {100 * result['top1_agreement']:.2f} %  PPL ratio {result['ppl_ratio']:.4f}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of pydoc_data.topics scored")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: the usable physical cores)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tokens = text_tokens(args.tokens)
    rows = rows_for(str(default_model_path()), tokens, args.threads)
    for name in ("awq-w4a16", "w8a8"):
        path = REAL / name
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        rows += rows_for(str(path), [t for t in tokens if t < vocab], args.threads)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
