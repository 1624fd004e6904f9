"""Write the Gemma 3 and gpt-oss compressed-tensors fixtures in tests/data/windowed/ with llm-compressor itself.

Run in a virtualenv of its own (never quill's: llm-compressor pins its own dependencies), e.g.
    uv venv /tmp/lc && uv pip install -p /tmp/lc/bin/python torch==2.13.0 llmcompressor transformers==5.23.0
    /tmp/lc/bin/python tests/tools/make_windowed_ct.py
The models are the tests' tiny random ones (tests/gemma3_util.py, tests/gpt_oss_util.py: same initialisation)
at widths that groups of 32 divide, saved in float32; GPTQ (W4A16, symmetric, groups of 32, lm_head and
routers kept) calibrated on 16 random sequences (``gemma3_text`` etc. on the command line: only those).
gpt-oss's fused experts are written as one Linear per expert and projection (the tool's own MoE handling).
Gemma 4 is refused with KV-shared layers (llm-compressor 0.14.1's layer-by-layer calibration runs a shared
layer without the keys its source layer left: ``KeyError: 'sliding_attention'``), so its fixture has none;
its per-layer input width is 32 (8 is not a multiple of the group; the real models' is 256).
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
from make_qwen3_5_ct import calibration, word_tokenizer  # noqa: E402

from tests.gemma3_util import hf_gemma3  # noqa: E402
from tests.gemma4_util import hf_gemma4  # noqa: E402
from tests.gpt_oss_util import hf_gpt_oss  # noqa: E402

OUT = HERE.parent / "data" / "windowed"
WIDTHS = dict(hidden_size=96, head_dim=16)  # q / o 96 wide, k / v 32: every in-width a multiple of 32
MODELS = {"gemma3_text": lambda: hf_gemma3(seed=3, intermediate_size=96, **WIDTHS),
          "gemma4_text": lambda: hf_gemma4(seed=3, intermediate_size=96, global_head_dim=32,
                                             hidden_size_per_layer_input=32, num_kv_shared_layers=0, **WIDTHS),
          "gpt_oss": lambda: hf_gpt_oss(seed=3, intermediate_size=32, **WIDTHS)}


def main() -> None:
    import llmcompressor
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    for model_type, make in MODELS.items():
        if sys.argv[1:] and model_type not in sys.argv[1:]:
            continue
        hf = make()
        name = f"ct-w4a16-g32-{model_type}"
        src = Path(tempfile.mkdtemp()) / name  # oneshot reads the model's config back from its directory
        hf.save_pretrained(src)
        word_tokenizer().save_pretrained(src)
        recipe = GPTQModifier(targets="Linear", ignore=["lm_head", "re:.*router$"],
                              config_groups={"group_0": {"targets": ["Linear"], "weights": {
                                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                  "group_size": 32}}})
        try:
            model = oneshot(model=str(src), dataset=calibration(), recipe=recipe, max_seq_length=96,
                            num_calibration_samples=16)
        except Exception as e:  # noqa: BLE001 -- a tool refusing an architecture is a finding to record
            print(f"REFUSED {name}: {type(e).__name__}: {e}")
            continue
        out = OUT / name
        model.save_pretrained(out, save_compressed=True)
        (out / "TOOLS.json").write_text(json.dumps({
            "llmcompressor": llmcompressor.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "script": "tests/tools/make_windowed_ct.py"}, indent=1) + "\n")
        print(out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
