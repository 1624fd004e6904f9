"""What each engine's arithmetic costs on one GGUF file: quill W4A16, W4A8, W4A8g and llama.cpp against
the float32 forward of the very same weights (quill's ``reference`` kernel: dequantize, float32 matmul).

    .venv/bin/python -m quill.bench.accuracy.llamacpp --llama-python .venv-llamacpp/bin/python [--gguf FILE]

The text is CPython's ``pydoc_data.topics`` (docs/ACCURACY.md), tokenized by quill; windows of 512
tokens, each scored on its second half (positions with 256-511 tokens of context), so llama.cpp and
quill see the same token ids.  llama.cpp (llama-cpp-python, run in its own virtualenv) quantizes
activations to 8 bits per block of 32 values (Q8_0) for its Q4 / Q8 matmuls and keeps its KV cache in
float16; quill's W4A8 quantizes them per token, its W4A8g (``activation_quant="int8-group"``) per token
and weight group, as llama.cpp does.  Reported per engine: mean / median / p99 KL of the
reference against it, top-1 agreement, the perplexity ratio, and the largest log-probability difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

LLAMA_SCRIPT = r"""
import sys, numpy as np
from llama_cpp import Llama
path, ids_file, out, window = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ids = np.load(ids_file).tolist()
llm = Llama(model_path=path, logits_all=True, n_ctx=window, n_batch=window, n_threads=2, verbose=False)
res = []
for w in range(0, len(ids) - window + 1, window):
    llm.reset()
    llm.eval(ids[w:w + window])
    s = np.array(llm.scores[window // 2 - 1:window - 1], dtype=np.float64)
    s -= s.max(-1, keepdims=True)
    res.append((s - np.log(np.exp(s).sum(-1, keepdims=True))).astype(np.float32))
np.save(out, np.concatenate(res))
"""


def quill_logprobs(path: str, ids: list[int], window: int, **kwargs) -> np.ndarray:
    """log-probs [windows * window / 2, V] of the second half of every window (predicting its next token)."""
    import quill
    from quill.models.base import ForwardContext

    llm = quill.LLM(path, skip_tokenizer_init=True, **kwargs)
    out = []
    with torch.no_grad():
        for w in range(0, len(ids) - window + 1, window):
            logits = llm.model(torch.tensor([ids[w:w + window]]), ForwardContext.causal(1, window))
            out.append(torch.log_softmax(logits[0, window // 2 - 1:window - 1].float(), -1).numpy())
    return np.concatenate(out)


def summary(ref: np.ndarray, other: np.ndarray, targets: np.ndarray) -> dict:
    ref, other = ref.astype(np.float64), other.astype(np.float64)
    kl = (np.exp(ref) * (ref - other)).sum(-1)
    rows = np.arange(len(targets))
    return {"mean_kl": float(kl.mean()), "median_kl": float(np.median(kl)), "p99_kl": float(np.percentile(kl, 99)),
            "same_top1": float((other.argmax(-1) == ref.argmax(-1)).mean()),
            "ppl_ratio": float(np.exp(ref[rows, targets].mean() - other[rows, targets].mean())),
            "max_abs_dlogprob": float(np.abs(other - ref).max())}


def main() -> None:
    from pydoc_data.topics import topics

    import quill
    from quill.default_model import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", required=True, help="a python with llama-cpp-python (never quill's own venv)")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    path = str(args.gguf or default_model_path())
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = quill.LLM(path).tokenizer.encode(text)[:args.windows * args.window]
    targets = np.concatenate([ids[w + args.window // 2:w + args.window]
                              for w in range(0, len(ids) - args.window + 1, args.window)])
    # float activations spelled out: a GGUF file's default is llama.cpp's int8 arithmetic (W4A8g)
    ref = quill_logprobs(path, ids, args.window, kernel="reference", activation_quant="none")
    runs = {"quill W4A16": quill_logprobs(path, ids, args.window, activation_quant="none"),
            "quill W4A8": quill_logprobs(path, ids, args.window, activation_quant="int8"),
            "quill W4A8g": quill_logprobs(path, ids, args.window, activation_quant="int8-group")}
    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/ids.npy", np.array(ids))
        subprocess.run([args.llama_python, "-c", LLAMA_SCRIPT, path, f"{tmp}/ids.npy", f"{tmp}/out.npy",
                        str(args.window)], check=True)
        runs["llama.cpp"] = np.load(f"{tmp}/out.npy")
    print(f"{Path(path).name}: {len(targets)} scored tokens of pydoc_data.topics, against the float32 forward "
          "of the same weights (kernel=reference)")
    results = {}
    for name, lp in runs.items():
        r = results[name] = summary(ref, lp, targets)
        print(f"  {name:12s} mean KL {r['mean_kl']:.5f}  median {r['median_kl']:.5f}  p99 {r['p99_kl']:.4f}  "
              f"same top-1 {100 * r['same_top1']:.2f} %  PPL ratio {r['ppl_ratio']:.4f}  "
              f"max |d logprob| {r['max_abs_dlogprob']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"gguf": path, "scored_tokens": len(targets), "results": results}, indent=1))


if __name__ == "__main__":
    main()
