"""llm-compressor's own GPTQ and AWQ (W4A16, group 64) of the accuracy base, for docs/ACCURACY.md.

Run in the tool virtualenv of scripts/make_real_checkpoints.py (never quill's own), after
quill/bench/accuracy/models.py wrote WORK_DIR/base-bf16:

    /tmp/toolvenv/bin/python quill/bench/accuracy/tool_models.py WORK_DIR

A standalone script (that virtualenv has no quill): it is never imported by quill.

writes WORK_DIR/llmc-gptq-w4g64 (GPTQModifier, symmetric) and WORK_DIR/llmc-awq-w4g64 (AWQModifier,
asymmetric), compressed-tensors pack-quantized, calibrated on standard-library docstrings (no download).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# scripts/make_real_checkpoints.py is the tool recipe both share; this directory's own modules
# (models.py, table.py, ...) must not shadow the tool's imports, so scripts/ replaces it on the path
sys.path[0] = str(Path(__file__).resolve().parents[3] / "scripts")
from make_real_checkpoints import calibration, quantize  # noqa: E402


def recipes():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier

    def group(symmetric: bool):
        return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=64))}
    return {"llmc-gptq-w4g64": [GPTQModifier(ignore=["lm_head"], config_groups=group(True))],
            "llmc-awq-w4g64": [AWQModifier(ignore=["lm_head"], config_groups=group(False))]}


def main(work: str) -> None:
    from transformers import AutoTokenizer
    base = Path(work) / "base-bf16"
    tok = AutoTokenizer.from_pretrained(str(base))
    data = calibration(tok, vocab=None)
    for name, recipe in recipes().items():
        out, tmp = Path(work) / name, Path(work) / f".{name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        quantize(base, tmp, recipe, data, tok)
        for f in base.iterdir():  # the tokenizer beside the weights (quill's, from the GGUF)
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, tmp / f.name)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)  # whole or not at all: run.sh compares what exists
        print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
