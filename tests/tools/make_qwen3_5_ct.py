"""Write the Qwen3.5 compressed-tensors fixtures in tests/data/qwen3_5/ with llm-compressor itself.

Run in a virtualenv of its own (never quill's: llm-compressor pins its own dependencies), e.g.
    uv venv /tmp/lc && uv pip install -p /tmp/lc/bin/python torch==2.13.0 llmcompressor transformers==5.23.0
    /tmp/lc/bin/python tests/tools/make_qwen3_5_ct.py
The models are tests/test_qwen3_5.py's tiny random ones (same config and initialisation, seed 0), saved in
float32; GPTQ (W4A16, symmetric, groups of 32, lm_head kept) calibrated on 16 random sequences.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
from tests.qwen3_5_util import VOCAB, hf_qwen3_5  # noqa: E402

OUT = HERE.parent / "data" / "qwen3_5"


def calibration():
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (16, 96), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 96] * 16})


def word_tokenizer():
    """llm-compressor wants a processor beside a tokenized dataset: a word-level one over the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3} | {f"w{i}": i for i in range(4, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def main() -> None:
    import tempfile

    import llmcompressor
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    for moe in (False, True):
        hf = hf_qwen3_5(moe, **({"shared_expert_intermediate_size": 64} if moe else {}))  # groups of 32
        name = f"ct-w4a16-g32-{hf.config.model_type}"
        src = Path(tempfile.mkdtemp()) / name  # oneshot reads the model's config back from its directory
        hf.save_pretrained(src)
        word_tokenizer().save_pretrained(src)
        recipe = GPTQModifier(targets="Linear", ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"],
                              config_groups={"group_0": {"targets": ["Linear"], "weights": {
                                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                  "group_size": 32}}})
        model = oneshot(model=str(src), dataset=calibration(), recipe=recipe, max_seq_length=96,
                        num_calibration_samples=16)
        out = OUT / name
        model.save_pretrained(out, save_compressed=True)
        (out / "TOOLS.json").write_text(json.dumps({
            "llmcompressor": llmcompressor.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "script": "tests/tools/make_qwen3_5_ct.py"}, indent=1) + "\n")
        print(out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
