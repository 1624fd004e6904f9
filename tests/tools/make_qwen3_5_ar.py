"""Write the Qwen3.5 AutoRound fixtures in tests/data/qwen3_5/ with auto-round itself.

Run in a virtualenv of its own (never quill's), e.g.
    uv venv /tmp/ar && uv pip install -p /tmp/ar/bin/python torch==2.13.0 auto-round transformers==5.23.0
    /tmp/ar/bin/python tests/tools/make_qwen3_5_ar.py
The models are tests/qwen3_5_util.py's tiny random ones (seed 0); W4 symmetric, groups of 32, a few tuning
iterations on random word sequences (``0`` on the command line: none), exported in the formats asked for
(auto_round, auto_gptq, auto_awq).

auto-round 0.16.1 (transformers 5.23) refuses both models at their full-attention layer (layer 3): its
block-wise pass hands the layer the [batch, seq] int64 padding mask ("Expected attn_mask dtype to be bool
or float", with or without tuning iterations; eager attention fails on the shape instead).  So there are
no AutoRound fixtures of Qwen3.5 yet; rerun this when a release handles hybrid models.
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
from make_qwen3_5_ct import word_tokenizer  # noqa: E402

from tests.qwen3_5_util import VOCAB, hf_qwen3_5  # noqa: E402

OUT = HERE.parent / "data" / "qwen3_5"
FORMATS = [f for f in sys.argv[1:] if not f.isdigit()] or ["auto_round", "auto_gptq", "auto_awq"]
ITERS = next((int(f) for f in sys.argv[1:] if f.isdigit()), 4)


def texts(n: int = 16, words: int = 64) -> list[str]:
    g = torch.Generator().manual_seed(2)
    return [" ".join(f"w{i}" for i in torch.randint(4, VOCAB, (words,), generator=g).tolist()) for _ in range(n)]


def main() -> None:
    import auto_round
    import transformers
    from auto_round import AutoRound

    for moe in (False, True):
        for fmt in FORMATS:
            hf = hf_qwen3_5(moe, **({"shared_expert_intermediate_size": 64} if moe else {}))  # groups of 32
            name = f"ar-{fmt.replace('_', '')}-g32-{hf.config.model_type}"
            ar = AutoRound(hf, word_tokenizer(), bits=4, group_size=32, sym=True, iters=ITERS, nsamples=16, seqlen=64,
                           dataset=texts(), batch_size=4)
            out = OUT / name
            try:
                ar.quantize_and_save(str(out), format=fmt)
            except Exception as e:  # noqa: BLE001 -- a tool refusing an architecture is a finding to record
                print(f"REFUSED {name}: {type(e).__name__}: {e}")
                continue
            tools = {"auto_round": auto_round.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "script": "tests/tools/make_qwen3_5_ar.py", "format": fmt}
            (out / "TOOLS.json").write_text(json.dumps(tools, indent=1) + "\n")
            print(out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    tempfile.tempdir = None
    main()
