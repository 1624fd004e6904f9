"""Loading: model resolution, typed errors for bad checkpoints, Hub ids offline, threads, load memory."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import quill
from quill.engine.hub import looks_like_hub_id, resolve_model
from quill.engine.loader import build_model
from quill.engine.memory import peak_bytes, reset_peak, rss_bytes
from quill.errors import CheckpointError, ModelError
from quill.formats.checkpoint import open_checkpoint
from quill.kernels import KernelPolicy, KernelSelector
from quill.platform import detect
from tests.model_util import hf_model, save_hf_dir


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_hf_dir(hf_model("qwen2", seed=41), tmp_path_factory.mktemp("loader") / "qwen2", tokenizer=False)


def copy_with(src, dst, edit_tensors=None, edit_config=None):
    """A copy of checkpoint ``src`` with its tensors and/or config edited."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def load(path, **kw):
    return build_model(open_checkpoint(path), KernelSelector(detect(), KernelPolicy()), **kw)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no config.json"):
        quill.LLM(str(tmp_path))


def test_unsupported_model_type_lists_supported(saved, tmp_path):
    d = copy_with(saved, tmp_path / "gpt2", edit_config=lambda c: c.update(model_type="gpt2"))
    with pytest.raises(ModelError, match="model_type .gpt2. is not supported; supported: gemma3, gemma3_text, "
                       "gemma4, gemma4_text, gpt_oss, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_5, "
                       "qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe$"):
        load(d)


def test_missing_tensor_names_the_layer(saved, tmp_path):
    d = copy_with(saved, tmp_path / "missing", edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="no quantized layer or tensor for 'model.layers.1.mlp.up_proj' "
                                              r"\(expected 'model.layers.1.mlp.up_proj.weight'\)"):
        load(d)
    d = copy_with(saved, tmp_path / "nobias", edit_tensors=lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.k_proj.bias' is missing"):
        load(d)
    d = copy_with(saved, tmp_path / "nonorm", edit_tensors=lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="'model.norm'"):
        load(d)


def test_unexpected_and_misshapen_tensors(saved, tmp_path):
    d = copy_with(saved, tmp_path / "extra", edit_tensors=lambda t: t.update({"model.layers.0.mlp.router.weight":
                                                                             torch.zeros(4, 64)}))
    with pytest.raises(CheckpointError, match="no place for: model.layers.0.mlp.router.weight"):
        load(d)

    def shrink(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :10].contiguous()
    d = copy_with(saved, tmp_path / "shape", edit_tensors=shrink)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \[64, 10\], "
                                              r"the model expects \[64, 96\]"):
        load(d)
    d = copy_with(saved, tmp_path / "inv", edit_tensors=lambda t: t.update(
        {"model.rotary_emb.inv_freq": torch.ones(8)}))
    assert load(d).model is not None  # recomputed tables some exports carry are ignored


def test_tied_embedding_without_tie_flag_needs_lm_head(saved, tmp_path):
    d = copy_with(saved, tmp_path / "untied", edit_config=lambda c: c.update(tie_word_embeddings=False))
    with pytest.raises(CheckpointError, match="'lm_head'"):
        load(d)


def test_hub_ids_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing can be found locally
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not looks_like_hub_id("./models/x") and not looks_like_hub_id("a/b/c")
    with pytest.raises(CheckpointError, match="could not get model 'quill-test/no-such-model'.*offline mode.*"
                                              "pass the local directory"):
        resolve_model("quill-test/no-such-model", offline=True)
    with pytest.raises(CheckpointError, match="no such file or directory"):
        resolve_model(str(tmp_path / "not-here"))


def test_threads_default_to_the_physical_cores_this_process_may_use(saved):
    before = torch.get_num_threads()
    try:
        quill.LLM(str(saved), skip_tokenizer_init=True, threads=1)
        assert torch.get_num_threads() == 1
        llm = quill.LLM(str(saved), skip_tokenizer_init=True)
        assert llm.threads == detect().default_threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_peak_load_memory_within_bound(tmp_path):
    """bf16 on disk -> float32 in memory: every layer is converted, one at a time, and nothing is held twice."""
    hf = hf_model("llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=2048,
                  num_attention_heads=8, num_key_value_heads=4, seed=42)
    d = save_hf_dir(hf, tmp_path / "big", tokenizer=False, dtype=torch.bfloat16)
    del hf
    loaded = load(d)
    m = loaded.memory
    # linears + norms; the embedding stays bf16 as stored (a view of the file's map, rows converted on lookup)
    params = sum(i.num_weights for i in loaded.layers if i.kind != "embedding") + 2 * 256 * 4 + 256
    assert m.resident >= 0.8 * params * 4  # the float32 model really is resident
    assert m.within_bound, m
    assert reset_peak() == m.peak_reset
    assert peak_bytes() >= rss_bytes() > 0
