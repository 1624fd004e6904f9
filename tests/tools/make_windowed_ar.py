"""Write the Gemma 3 and gpt-oss AutoRound fixtures in tests/data/windowed/ with auto-round itself.

Run in a virtualenv of its own (never quill's), e.g.
    uv venv /tmp/ar && uv pip install -p /tmp/ar/bin/python torch==2.13.0 auto-round transformers==5.23.0
    /tmp/ar/bin/python tests/tools/make_windowed_ar.py
The models are tests/tools/make_windowed_ct.py's (the tests' tiny random ones at widths groups of 32
divide); W4 symmetric, groups of 32, a few tuning iterations on random word sequences (``0`` on the command
line: none), exported in the formats asked for (auto_round, auto_gptq, auto_awq).  A format the tool refuses
for a model is printed as REFUSED and written nowhere: auto-round 0.16.1 refuses Gemma 4 (its block-wise pass
hands a global layer, head size 32, the local layers' rotary tables, head size 16: "Attempting to broadcast a
dimension of length 16"), so only Gemma 3 and gpt-oss have AutoRound fixtures.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE))
from make_qwen3_5_ar import texts  # noqa: E402
from make_qwen3_5_ct import word_tokenizer  # noqa: E402
from make_windowed_ct import MODELS, OUT  # noqa: E402

FORMATS = [f for f in sys.argv[1:] if not f.isdigit() and f not in MODELS] or ["auto_round", "auto_gptq", "auto_awq"]
ITERS = next((int(f) for f in sys.argv[1:] if f.isdigit()), 4)


def write_expected(d: Path) -> None:
    """expected.safetensors: W = QuantLinear(I)^T for every GPTQ-packed linear of ``d`` (zero points stored
    minus one: auto-round's qlinear_torch_zp, the auto_gptq convention)."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    from safetensors import safe_open
    from safetensors.torch import save_file

    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    f = safe_open(str(d / "model.safetensors"), "pt")
    out = {}
    for key in f.keys():
        if not key.endswith(".qweight"):
            continue
        name = key.removesuffix(".qweight")
        qweight, scales = f.get_tensor(key), f.get_tensor(f"{name}.scales")
        infeatures, outfeatures = qweight.shape[0] * 32 // qc["bits"], qweight.shape[1]
        ql = QuantLinear(qc["bits"], qc["group_size"], infeatures, outfeatures, bias=False)
        ql.qweight, ql.qzeros, ql.scales = qweight, f.get_tensor(f"{name}.qzeros"), scales.float()
        with torch.no_grad():
            out[name] = ql(torch.eye(infeatures)).T.contiguous()
    save_file(out, str(d / "expected.safetensors"))


def main() -> None:
    import auto_round
    import transformers
    from auto_round import AutoRound

    only = [a for a in sys.argv[1:] if a in MODELS]
    for model_type, make in MODELS.items():
        if only and model_type not in only:
            continue
        for fmt in FORMATS:
            name = f"ar-{fmt.replace('_', '')}-g32-{model_type}"
            ar = AutoRound(make(), word_tokenizer(), bits=4, group_size=32, sym=True, iters=ITERS, nsamples=16,
                           seqlen=64, dataset=texts(), batch_size=4)
            out = OUT / name
            try:
                ar.quantize_and_save(str(out), format=fmt)
            except Exception as e:  # noqa: BLE001 -- a tool refusing an architecture is a finding to record
                print(f"REFUSED {name}: {type(e).__name__}: {e}")
                continue
            sub = [p for p in out.iterdir() if p.is_dir()]  # the tool writes into out/w4g32/
            if len(sub) == 1:
                for p in sub[0].iterdir():
                    p.rename(out / p.name)
                sub[0].rmdir()
            if fmt in ("auto_round", "auto_gptq"):
                write_expected(out)
            tools = {"auto_round": auto_round.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "script": "tests/tools/make_windowed_ar.py", "format": fmt}
            (out / "TOOLS.json").write_text(json.dumps(tools, indent=1) + "\n")
            print(out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    tempfile.tempdir = None
    if sys.argv[1:2] == ["--expected"]:  # only (re)write expected.safetensors of existing checkpoints
        for d in sys.argv[2:]:
            write_expected(Path(d))
    else:
        main()
