"""Render docs/bench/accuracy/*.json (quill/bench/accuracy/run.sh) as the Markdown table of docs/ACCURACY.md.

    .venv/bin/python -m quill.bench.accuracy.table [DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = [  # file stem -> (what OTHER is, precision)
    ("default-q4_1-a16-vs-bf16", "GGUF Q4_1 (the default model as downloaded)", "W4A16"),
    ("default-q4_1-a8-vs-bf16", "GGUF Q4_1 (the default model as downloaded)", "W4A8"),
    ("q4_0-a16-vs-bf16", "GGUF Q4_0, llama.cpp's quantizer", "W4A16"),
    ("q4_0-a8-vs-bf16", "GGUF Q4_0, llama.cpp's quantizer", "W4A8"),
    ("q8_0-a16-vs-bf16", "GGUF Q8_0, llama.cpp's quantizer", "W8A16"),
    ("q8_0-a8-vs-bf16", "GGUF Q8_0, llama.cpp's quantizer", "W8A8"),
    ("llmc-gptq-w4g64-a16-vs-bf16", "compressed-tensors, llm-compressor GPTQModifier, sym g64", "W4A16"),
    ("llmc-gptq-w4g64-a8-vs-bf16", "compressed-tensors, llm-compressor GPTQModifier, sym g64", "W4A8"),
    ("llmc-awq-w4g64-a16-vs-bf16", "compressed-tensors, llm-compressor AWQModifier, asym g64", "W4A16"),
    ("llmc-awq-w4g64-a8-vs-bf16", "compressed-tensors, llm-compressor AWQModifier, asym g64", "W4A8"),
    ("gptq-w4g64-a16-vs-bf16", "GPTQ v1 layout, RTN sym g64", "W4A16"),
    ("gptq-w4g64-a8-vs-bf16", "GPTQ v1 layout, RTN sym g64", "W4A8"),
    ("awq-w4g64-a16-vs-bf16", "AWQ GEMM layout, RTN asym g64", "W4A16"),
    ("awq-w4g64-a8-vs-bf16", "AWQ GEMM layout, RTN asym g64", "W4A8"),
    ("ct-w4a16-g64-a16-vs-bf16", "compressed-tensors pack-quantized, RTN sym g64", "W4A16"),
    ("ct-w4a16-g64-a8-vs-bf16", "compressed-tensors pack-quantized, RTN sym g64", "W4A8"),
    ("ct-w8a16-a16-vs-bf16", "compressed-tensors int-quantized, RTN int8 per channel", "W8A16"),
    ("ct-w8a16-a8-vs-bf16", "compressed-tensors int-quantized, RTN int8 per channel", "W8A8"),
    ("default-q4_1-a8-vs-a16", "GGUF Q4_1: W4A8 against W4A16 of the same file", "W4A8 vs W4A16"),
]


def main(directory: str = "docs/bench/accuracy") -> None:
    d = Path(directory)
    print("| OTHER | precision | PPL(other) | PPL ratio | mean KL | median KL | p99 KL | same top-1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for stem, what, prec in ROWS:
        f = d / f"{stem}.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        if stem.endswith("vs-bf16"):
            base = (r["ppl_base"], r.get("ppl_base_stderr"))
        ppl = f"{r['ppl_other']:.3f}" + (f" +/- {r['ppl_other_stderr']:.3f}" if "ppl_other_stderr" in r else "")
        print(f"| {what} | {prec} | {ppl} | {r['ppl_ratio']:.4f} +/- "
              f"{r['ppl_ratio'] * r['ln_ppl_ratio_stderr']:.4f} | {r['kl_mean']:.5f} +/- {r['kl_stderr']:.5f} | "
              f"{r['kl_median']:.5f} | {r['kl_p99']:.5f} | {100 * r['top1_agreement']:.2f} % |")
    if base is not None:
        err = f" +/- {base[1]:.3f}" if base[1] is not None else ""
        print(f"\nPPL(bf16 base) = {base[0]:.3f}{err}")


if __name__ == "__main__":
    main(*sys.argv[1:])
