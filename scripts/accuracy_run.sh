#!/usr/bin/env bash
# Reproduce the figures of docs/ACCURACY.md (raw JSON in docs/bench/accuracy/).
#   scripts/accuracy_run.sh [WORK_DIR] [LLAMA_PYTHON]
# WORK_DIR gets the checkpoints of scripts/accuracy_models.py; LLAMA_PYTHON (a python with
# llama-cpp-python, e.g. from ../shared/wheels in its own virtualenv) adds llama.cpp's Q4_0 / Q8_0.
set -euo pipefail
cd "$(dirname "$0")/.."
ACC=${1:-/tmp/quill-accuracy}
LLAMA_PY=${2:-}
N=${N:-32768}  # tokens of pydoc_data.topics scored
OUT=docs/bench/accuracy
Q=.venv/bin/quill
mkdir -p "$OUT" "$ACC"
.venv/bin/python scripts/accuracy_models.py "$ACC" ${LLAMA_PY:+--llama-python "$LLAMA_PY"}
TEXT=(--pydoc-topics --max-tokens "$N" --quiet)
DEFAULT=$(.venv/bin/python -c "from quill.default_model import default_model_path; print(default_model_path())")

# int8 activations against none on the default model as downloaded (Q4_1 GGUF: W4A8 against W4A16)
$Q eval compare "${TEXT[@]}" --other-act-quant int8 --json "$OUT/default-q4_1-a8-vs-a16.json"
# the bf16 base, scored once; the default GGUF against it
$Q eval compare "$ACC/base-bf16" "$DEFAULT" "${TEXT[@]}" --save-base "$ACC/base.safetensors" \
    --json "$OUT/default-q4_1-a16-vs-bf16.json"
$Q eval compare "$ACC/base.safetensors" "$DEFAULT" "${TEXT[@]}" --act-quant int8 \
    --json "$OUT/default-q4_1-a8-vs-bf16.json"
# llmc-*: llm-compressor's own GPTQ / AWQ (scripts/accuracy_tool_models.py, in its tool virtualenv)
for m in gptq-w4g64 awq-w4g64 ct-w4a16-g64 ct-w8a16 q4_0.gguf q8_0.gguf llmc-gptq-w4g64 llmc-awq-w4g64; do
    [ -e "$ACC/$m" ] || continue
    # a16: weight-only kernels; a8: int8 activations per token (W4A8 / W8A8)
    $Q eval compare "$ACC/base.safetensors" "$ACC/$m" "${TEXT[@]}" --json "$OUT/${m%.gguf}-a16-vs-bf16.json"
    $Q eval compare "$ACC/base.safetensors" "$ACC/$m" "${TEXT[@]}" --act-quant int8 \
        --json "$OUT/${m%.gguf}-a8-vs-bf16.json"
done
