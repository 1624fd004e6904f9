"""Write the Gemma 3, Gemma 4 and gpt-oss GPTQModel fixtures in tests/data/windowed/ with GPTQModel itself.

Run in a virtualenv of its own (never quill's), e.g.
    uv venv /tmp/gq && uv pip install -p /tmp/gq/bin/python torch==2.13.0 gptqmodel==7.6.0 transformers==5.23.0
    /tmp/gq/bin/python tests/tools/make_windowed_gptq.py
gptqmodel 7.7.0 requires torch>=2.14.1, so 7.6.0 is the newest beside torch 2.13.0; it installs from its sdist
with no build step and quantizes on the CPU.  On a machine of one or two CPUs it cannot start (gptqmodel/__init__.py
gives its "cpu" thread pool (cpus + 1) // 2 workers and its "model_loader:cpu" pool a fixed 2: "ValueError: Virtual
pool 'model_loader:cpu' requests 2 workers but parent 'cpu' only has 1"), so this script sets
GPTQMODEL_CPU_WORKERS=2 unless it is set.

The models are tests/tools/make_windowed_ct.py's (the tests' tiny random ones at widths groups of 32 divide), except
that Gemma 4 keeps the tests' two KV-shared layers (llm-compressor refuses them; GPTQModel quantizes them, and
writes no k_proj / v_proj for them).  GPTQ through GPTQModel's own API (GPTQConfig: 4 bits, groups of 32,
symmetric, desc_act, so every linear has a permuted g_idx; lm_head, routers and Gemma 4's model-level per-layer
projection stay dense) on 16 random sequences of 96 tokens, loaded in float32 (GPTQModel's default on the CPU is
bfloat16) and saved in its default format (checkpoint_format "gptq": v1, zeros stored minus one; float16 scales,
the other tensors float32 like the other tools' fixtures).  ``gemma3_text`` etc. on the command line: only those.
GPTQModel writes its logs under ./logs: the script runs in a temporary directory.  gpt-oss's fused experts are
written as one Linear per expert and projection (with biases), gate_proj and up_proj being the halves of the fused
gate_up_proj, not the gate and up (check_names says how).

expected.safetensors: every quantized linear as GPTQModel dequantizes it, float32 [out, in]: the checkpoint loaded
back by GPTQModel.load (its torch kernel, which converts the v1 zeros to v2 on load), the scales (checked equal to
the stored ones) widened to float32, then its TorchLinear.dequantize_weight (in float16 that product is rounded:
the same float32 evaluation as make_windowed_ar.py's).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE))
from make_qwen3_5_ct import word_tokenizer  # noqa: E402
from make_windowed_ct import MODELS, OUT, WIDTHS  # noqa: E402

from tests.gemma4_util import hf_gemma4  # noqa: E402

MODELS = MODELS | {"gemma4_text": lambda: hf_gemma4(seed=3, intermediate_size=96, global_head_dim=32,
                                                      hidden_size_per_layer_input=32, **WIDTHS)}


def calibration() -> list[dict]:
    g = torch.Generator().manual_seed(1)  # make_qwen3_5_ct.calibration()'s sequences
    ids = torch.randint(4, 320, (16, 96), generator=g).tolist()
    return [{"input_ids": x, "attention_mask": [1] * len(x)} for x in ids]


def write_expected(d: Path) -> dict[str, torch.Tensor]:
    """expected.safetensors of checkpoint ``d`` (see the module docstring); returns it."""
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors import safe_open
    from safetensors.torch import save_file

    f = safe_open(str(d / "model.safetensors"), "pt")
    model = GPTQModel.load(str(d), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    out = {}
    for name, m in model.model.named_modules():
        if not isinstance(m, BaseQuantLinear):
            continue
        for t in ("scales", "g_idx", "qweight"):  # what was loaded is what is stored
            assert torch.equal(getattr(m, t), f.get_tensor(f"{name}.{t}")), (name, t)
        m.scales = m.scales.float()
        with torch.no_grad():
            out[name] = type(m).dequantize_weight(m).T.float().contiguous()  # the eager one, not its compiled copy
    save_file(out, str(d / "expected.safetensors"))
    return out


def check_names(hf, weights: dict[str, torch.Tensor]) -> None:
    """Each dequantized linear is near the float weight it came from in the source model.  GPTQModel (through
    defuser's generic split of a fused gate_up_proj into halves) writes gpt-oss's experts as gate_proj = the first
    half of transformers' gate_up_proj columns and up_proj = the second: gate and up interleaved across both (a
    gpt-oss gate is column 2 j, its up 2 j + 1), unlike llm-compressor and auto-round (gate_proj = the even columns).
    """
    src = {}
    for name, p in hf.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = p.shape[-1] // 2
            for e in range(p.shape[0]):
                src[name.replace("gate_up_proj", f"{e}.gate_proj")] = p[e, :, :half].T
                src[name.replace("gate_up_proj", f"{e}.up_proj")] = p[e, :, half:].T
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(p.shape[0]):
                src[name.replace("down_proj", f"{e}.down_proj")] = p[e].T
        elif name.endswith(".weight"):
            src[name.removesuffix(".weight")] = p
    for name, w in weights.items():
        err = ((w - src[name].float()).norm() / src[name].float().norm()).item()
        assert err < 0.3, (name, err)  # 4-bit groups of 32: about 0.12; another tensor: about 1.4


def main() -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    os.chdir(tempfile.mkdtemp())
    import gptqmodel
    import transformers
    from gptqmodel import GPTQConfig, GPTQModel

    for model_type, make in MODELS.items():
        if sys.argv[1:] and model_type not in sys.argv[1:]:
            continue
        hf = make()
        name = f"gptqmodel-g32-{model_type}"
        src = Path(tempfile.mkdtemp()) / name
        hf.save_pretrained(src)
        word_tokenizer().save_pretrained(src)
        qcfg = GPTQConfig(bits=4, group_size=32, sym=True, desc_act=True)
        out = OUT / name
        try:
            model = GPTQModel.load(str(src), qcfg, device="cpu", dtype=torch.float32)
            model.quantize(calibration(), batch_size=1)
            shutil.rmtree(out, ignore_errors=True)
            model.save(str(out))
        except Exception as e:  # noqa: BLE001 -- a tool refusing an architecture is a finding to record
            print(f"REFUSED {name}: {type(e).__name__}: {e}")
            continue
        (out / "quant_log.csv").unlink(missing_ok=True)  # its per-module loss log, not part of the checkpoint
        check_names(hf, write_expected(out))
        (out / "TOOLS.json").write_text(json.dumps({
            "gptqmodel": gptqmodel.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "script": "tests/tools/make_windowed_gptq.py",
            "config": "GPTQConfig(bits=4, group_size=32, sym=True, desc_act=True)"}, indent=1) + "\n")
        print(out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
