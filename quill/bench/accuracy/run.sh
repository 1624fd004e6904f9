#!/usr/bin/env bash
# Reproduce the figures of docs/ACCURACY.md (raw JSON in docs/bench/accuracy/).
#   quill/bench/accuracy/run.sh [WORK_DIR] [LLAMA_PYTHON]
# WORK_DIR gets the checkpoints of quill/bench/accuracy/models.py; LLAMA_PYTHON (a python with
# llama-cpp-python, e.g. from ../shared/wheels in its own virtualenv) adds llama.cpp's Q4_0 / Q8_0.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the checkout: .venv and docs/ are there
ACC=${1:-/tmp/quill-accuracy}
LLAMA_PY=${2:-}
N=${N:-32768}  # tokens of pydoc_data.topics scored
OUT=docs/bench/accuracy
Q=.venv/bin/quill
mkdir -p "$OUT" "$ACC"
.venv/bin/python -m quill.bench.accuracy.models "$ACC" ${LLAMA_PY:+--llama-python "$LLAMA_PY"}
# a float32 KV cache and, on "a16" rows, float activations spelled out: quill's defaults (a float16
# cache; llama.cpp's int8 activations for GGUF files) have their own table (quill/bench/accuracy/defaults.py)
TEXT=(--pydoc-topics --max-tokens "$N" --quiet --kv-cache-dtype float32)
DEFAULT=$(.venv/bin/python -c "from quill.default_model import default_model_path; print(default_model_path())")

# int8 activations against none on the default model as downloaded (Q4_1 GGUF: W4A8 against W4A16)
$Q eval compare "${TEXT[@]}" --act-quant none --other-act-quant int8 --json "$OUT/default-q4_1-a8-vs-a16.json"
# the bf16 base, scored once; the default GGUF against it
$Q eval compare "$ACC/base-bf16" "$DEFAULT" "${TEXT[@]}" --act-quant none --save-base "$ACC/base.safetensors" \
    --json "$OUT/default-q4_1-a16-vs-bf16.json"
$Q eval compare "$ACC/base.safetensors" "$DEFAULT" "${TEXT[@]}" --act-quant int8 \
    --json "$OUT/default-q4_1-a8-vs-bf16.json"
# llmc-*: llm-compressor's own GPTQ / AWQ (quill/bench/accuracy/tool_models.py, in its tool virtualenv)
for m in gptq-w4g64 awq-w4g64 ct-w4a16-g64 ct-w8a16 q4_0.gguf q8_0.gguf llmc-gptq-w4g64 llmc-awq-w4g64; do
    [ -e "$ACC/$m" ] || continue
    # a16: weight-only kernels; a8: int8 activations per token (W4A8 / W8A8)
    $Q eval compare "$ACC/base.safetensors" "$ACC/$m" "${TEXT[@]}" --act-quant none --json "$OUT/${m%.gguf}-a16-vs-bf16.json"
    $Q eval compare "$ACC/base.safetensors" "$ACC/$m" "${TEXT[@]}" --act-quant int8 \
        --json "$OUT/${m%.gguf}-a8-vs-bf16.json"
done
