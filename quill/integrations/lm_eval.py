"""lm-evaluation-harness on quill's engine (``pip install 'quill[eval]'``).

    import lm_eval
    from quill.integrations.lm_eval import QuillLM
    lm_eval.simple_evaluate(model=QuillLM(pretrained="path/or.gguf", activation_quant="none"), tasks=["hellaswag"])

or ``lm_eval --model quill --model_args pretrained=PATH,activation_quant=none`` once this module is
imported (it registers the name "quill").  Every ``quill.options.RunOptions`` field is a model
argument.  Log-likelihoods are scored prompts (``LLM.score``: batched, with the contexts' full KV
blocks shared through the prefix cache); generation is ``LLM.generate`` with the task's stop strings.
"""

from __future__ import annotations

import warnings

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from quill.engine.llm import LLM
from quill.engine.sampling import SamplingParams
from quill.engine.scoring import ScoreSpec
from quill.errors import EvalError
from quill.formats.registry import QuillDeprecationWarning
from quill.options import RunOptions

# what lm-eval's create_from_arg_string adds to every model's arguments (meaningless for quill's engine,
# which batches continuously on the CPU it runs on)
_LM_EVAL_EXTRAS = frozenset({"batch_size", "max_batch_size", "device"})

@register_model("quill")
class QuillLM(TemplateLM):
    """An lm-eval ``LM`` whose every request runs on one quill ``LLM``.

    Args:
        pretrained: what ``quill.LLM`` loads (a directory, a .gguf file, a Hub id; None: the default model).
        max_gen_toks: the generation budget when a task gives none.
        llm: an already loaded ``quill.LLM`` to use instead of loading ``pretrained``.
        **options: ``quill.options.RunOptions`` fields (``quill.LLM``'s keywords: dtype, activation_quant,
            kv_cache_dtype, threads, kernel, isa, ...), strings as lm-eval's model_args give them or not.
            ``act_quant`` is the deprecated spelling of ``activation_quant``.
    """

    def __init__(self, pretrained: str | None = None, max_gen_toks: int = 256, llm: LLM | None = None, **options):
        super().__init__()
        self.options = run_options(options)
        self.llm = llm or LLM(pretrained, **self.options.llm_kwargs())
        if self.llm.tokenizer is None:
            raise EvalError("lm-eval needs the model's tokenizer (this LLM has skip_tokenizer_init=True)")
        self.tokenizer = self.llm.tokenizer
        self.max_gen_toks = int(max_gen_toks)

    # ---- what TemplateLM asks -------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.llm.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self.llm.context_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.path)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens is not False)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether greedy decoding would produce it) per request."""
        prompts, specs, wanted, out = [], [], [], [None] * len(requests)
        for i, (key, ctx, cont) in enumerate(requests):
            if not cont:
                out[i] = (0.0, True)
                continue
            if len(cont) >= self.max_length:
                raise EvalError(f"request {i}: a {len(cont)}-token continuation does not fit the model's "
                                f"{self.max_length}-token window")
            tokens = (ctx + cont)[-self.max_length:]  # keep the end: the continuation and the nearest context
            prompts.append(tokens)
            specs.append(ScoreSpec(first=len(tokens) - len(cont)))
            wanted.append((i, key, cont))
        if prompts:
            for (i, key, cont), s in zip(wanted, self.llm.score(prompts, specs)):
                greedy = bool((s.argmax == s.argmax.new_tensor(cont)).all())
                out[i] = (float(s.token_logprobs.double().sum()), greedy)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, out[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts in lm-eval's disjoint rolling windows.

        A window here is one token shorter than the model's length: quill scores tokens that are in
        the prompt, so a window's last token is fed too (lm-eval's HF model leaves it out)."""
        pieces, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            tokens = self.tok_encode(text, add_special_tokens=False)
            for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                    tokens, self.prefix_token_id, self.max_length - 1, context_len=1)):
                pieces.append((None, ctx, pred))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._loglikelihood_tokens(pieces)):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, if the task asks) generation cut at the task's stop strings."""
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params = [], []
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            max_tokens = int(kw.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kw.pop("do_sample", False))  # greedy unless the task samples or sets a temperature
            temperature = float(kw.pop("temperature", 1.0 if sample else 0.0))
            ids = self.tok_encode(context)
            room = self.max_length - max_tokens
            if room < 1:
                raise EvalError(f"max_gen_toks {max_tokens} leaves no room for a prompt in the model's "
                                f"{self.max_length}-token window")
            prompts.append({"prompt_token_ids": ids[-room:]})
            params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=until))
        outputs = self.llm.generate(prompts, params) if prompts else []
        texts = [o.text for o in outputs]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts


def run_options(args: dict) -> RunOptions:
    """The ``RunOptions`` of QuillLM's keyword arguments (lm-eval's own extras dropped, the old spelling
    ``act_quant`` accepted with a warning); an unknown key is an error naming the known ones."""
    args = {k: v for k, v in args.items() if k not in _LM_EVAL_EXTRAS}
    if "act_quant" in args:
        if "activation_quant" in args:
            raise EvalError("give activation_quant only (act_quant is its deprecated spelling)")
        warnings.warn("QuillLM(act_quant=...) is deprecated; write activation_quant (as quill.LLM does)",
                      QuillDeprecationWarning, stacklevel=3)
        args["activation_quant"] = args.pop("act_quant")
    if "activation_quant" in args and args["activation_quant"] is None:  # lm-eval parses the text "none" to None
        args["activation_quant"] = "none"
    return RunOptions.from_mapping(args, "QuillLM")
