"""The lm-evaluation-harness adapter: its log-likelihoods are the model's, and a local task runs end to end."""

import json

import pytest
import torch
from lm_eval.api.instance import Instance  # the test extras install lm-eval

import quill
from quill.engine.scoring import ScoreSpec
from quill.integrations.lm_eval import QuillLM
from tests.model_util import hf_model, save_hf_dir

DOCS = [
    {"question": "the capital of france is", "choices": [" paris.", " the dog", " hello"], "answer": 0},
    {"question": "the quick brown fox jumps over the", "choices": [" lazy dog", " answer?", " world"], "answer": 0},
    {"question": "hello world, what is the", "choices": [" capital", " answer?", " fox"], "answer": 1},
    {"question": "the lazy", "choices": [" dog", " paris"], "answer": 0},
]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    d = save_hf_dir(hf_model("llama"), tmp_path_factory.mktemp("lm-eval-llama"))
    return QuillLM(pretrained=str(d))


def model_logprob(llm, context: str, continuation: str) -> float:
    """Sum of the continuation tokens' log-probs, from prompt_logprobs of the whole text (the oracle)."""
    ctx = llm.tokenizer.encode(context)
    whole = llm.tokenizer.encode(context + continuation)
    out = llm.generate([{"prompt_token_ids": whole}], quill.SamplingParams(max_tokens=1, prompt_logprobs=0))
    lps = out[0].prompt_logprobs
    return sum(lps[i][whole[i]].logprob for i in range(len(ctx), len(whole)))


def test_loglikelihood_is_the_models_log_probability(lm):
    reqs = [Instance("loglikelihood", {}, (d["question"], c), 0) for d in DOCS for c in d["choices"]]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    for req, (lp, greedy) in zip(reqs, got):
        assert lp == pytest.approx(model_logprob(lm.llm, *req.args), abs=1e-4)
        assert isinstance(greedy, bool)
    # greedy is true exactly when every continuation token is the argmax
    ctx = lm.llm.tokenizer.encode("the capital of")
    best = lm.llm.score([ctx + [0]], ScoreSpec(first=len(ctx)))[0].argmax[0]
    cont = lm.llm.tokenizer.decode([int(best)])
    (lp, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, ("the capital of", cont), 0)], True)
    assert greedy == (lm.llm.tokenizer.encode("the capital of" + cont)[len(ctx):] == [int(best)])


def test_rolling_loglikelihood_covers_the_text_in_windows(lm):
    text = "the quick brown fox jumps over the lazy dog " * 40  # longer than the 128-token window
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], True)
    tokens = lm.tok_encode(text, add_special_tokens=False)
    assert len(tokens) > 128
    # the same windows scored by hand: 127 predicted tokens each, after the prefix token (first window) or
    # after the tokens before them that fill the window (a short last window gets more context)
    want, pos = 0.0, 0
    while pos < len(tokens):
        n = min(127, len(tokens) - pos)
        prompt = ([lm.prefix_token_id] + tokens[:n]) if pos == 0 else tokens[pos + n - 128:pos + n]
        s = lm.llm.score([prompt], ScoreSpec(first=len(prompt) - n))[0]
        want += float(s.token_logprobs.double().sum())
        pos += n
    assert total == pytest.approx(want, rel=1e-6)


def test_generate_until_stops_at_the_tasks_strings(lm):
    req = Instance("generate_until", {}, ("the capital of", {"until": ["."], "max_gen_toks": 12}), 0)
    out = lm.generate_until([req], True)
    ref = lm.llm.generate("the capital of", quill.SamplingParams(max_tokens=12, stop=["."], temperature=0))
    assert out == [ref[0].text] and "." not in out[0]


def test_a_local_task_runs_end_to_end(lm, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "quill_tiny.yaml").write_text(
        "task: quill_tiny\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    # (include_defaults=False: indexing the harness's thousands of built-in task files took 20 CPU seconds)
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
    res = simple_evaluate(model=lm, tasks=["quill_tiny"], task_manager=tasks,
                          num_fewshot=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    acc = res["results"]["quill_tiny"]["acc,none"]
    # the oracle: the choice with the highest log-probability, scored by hand
    right = 0
    for d in DOCS:
        scores = [model_logprob(lm.llm, d["question"], c) for c in d["choices"]]
        right += int(torch.tensor(scores).argmax()) == d["answer"]
    assert acc == pytest.approx(right / len(DOCS))
