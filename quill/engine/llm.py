"""The offline API: ``quill.LLM(model).generate(prompts, quill.SamplingParams(...))``.

    llm = quill.LLM("path/to/checkpoint")             # or a .gguf file, a Hub id, or None (default model)
    out = llm.generate(["Hello"], quill.SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text, out[0].finish_reason, out[0].timings.decode_tps)
    for chunk in llm.stream("Hello"):                  # text pieces as they are generated
        print(chunk.text, end="")
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quill.engine.core import EngineConfig, EngineCore
from quill.engine.draft import check_same_tokenizer
from quill.engine.hub import resolve_model
from quill.engine.loader import LoadedModel
from quill.engine.memory import keep_step_memory
from quill.engine.output import OutputProcessor, RequestFailed, RequestState, StreamChunk, check_prompt_ids
from quill.engine.sampling import Logprob, SamplingParams
from quill.engine.scoring import PromptScores, ScoreSpec
from quill.engine.sequence import Timings
from quill.engine.spec_config import SpeculativeConfig
from quill.engine.startup import load_model
from quill.engine.structured import GrammarCompiler
from quill.errors import ConfigError, GenerationError, KernelSelectionError
from quill.layers import LoadContext
from quill.options import ActQuant, RunOptions, describe_activations, describe_kv_cache, is_gguf
from quill.platform import Platform, detect
from quill.prepacked.store import PrepackedCache, cache_enabled
from quill.tokenizer import Tokenizer

Prompt = str | Sequence[int] | Mapping[str, Any]
Messages = Sequence[Mapping[str, Any]]


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's field names)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", or "error"
    stop_reason: int | str | None  # the stop token id or stop string; None for EOS or length
    # finish_reason "error": this prompt failed inside the engine ("ExceptionType: message", the traceback
    # is logged); the other prompts of the call are unaffected and ``text`` holds what came before
    error: str | None = None


@dataclass
class RequestOutput:
    """The result for one prompt: its tokens, its completion, and timings."""

    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    timings: Timings

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs


def _limited(platform: Platform, isa: str) -> Platform:
    """``platform`` without the ISA levels above ``isa`` (Platform.limited_to), a ConfigError if unknown."""
    try:
        return platform.limited_to(isa)
    except ValueError as e:
        raise ConfigError(f"isa: {e}") from None


class LLM:
    """A loaded model with its tokenizer, ready to generate.

    Args:
        model: a checkpoint directory, a ``.gguf`` file, a Hugging Face Hub id, or None for the default model.
        dtype: "float32" (the default and only compute dtype; exact against float32 references).
            "bfloat16" is accepted and runs as float32 with a warning: it decoded at 0.5-0.9x float32's
            speed on CPUs, so it is not offered.
        activation_quant: "auto" (default): the format's own arithmetic, "int8-group" for GGUF files
            (llama.cpp's: int8 activations per token and 32-value block) and float activations for AWQ,
            GPTQ, compressed-tensors and AutoRound checkpoints (their tools' forward); "none": float
            activations, GGUF too; "int8": int8 activations (W4A8 / W8A8), one scale per token;
            "int8-group": one scale per token and weight group.  A checkpoint that prescribes its own
            activation quantization (W8A8) always gets it.  ``llm.activation`` is what it resolved to.
        threads: torch threads (default: the physical cores this process may run on, see taskset or a cpuset).
        kernel: force one linear kernel by name (default: the best that can run each layer).
        moe_backend: force one MoE backend by name (default: the best that can run each MoE layer).
        skip_tokenizer_init: load no tokenizer; prompts must then be token ids and outputs have no text.
        max_model_len: cap the context window below the model's own.
        seed: seed of the sampler used by requests that give no seed of their own.
        offline: resolve Hub ids from the local cache only.
        progress: show a loading progress bar on stderr (default: when stderr is a terminal).
        platform: the CPU to choose kernels for (default: this one, ``quill.platform.detect()``).
        isa: "native" (default), or run the kernel variants of a weaker CPU on this one: "avx2" for an
            AVX2 + FMA + F16C machine such as AMD Zen 2 / 3 (every variant gives the same bits; for comparing
            speed and checking those paths on an AVX-512 host; torch's own ops follow
            ``ATEN_CPU_CAPABILITY=avx2``).
        engine_config: the engine core's batching and KV-cache sizes (``quill.engine.core.EngineConfig``).
        kv_cache_dtype: "auto" (float16, llama.cpp's default), "float32" (exact), "float16" or "bfloat16":
            the KV cache's element type (``EngineConfig.kv_cache_dtype``; given here it overrides
            engine_config's).
        cache: use the prepacked cache (default: on unless ``$QUILL_CACHE=0``): the kernel layouts are
            saved after the first load (on a thread) and read back on later ones (``quill.prepacked``).
        cache_dir: where (default ``$QUILL_CACHE_DIR``, else ``~/.cache/quill``).
        speculative_config: speculative decoding, vLLM's dict or its JSON text:
            ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}``
            or ``{"method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": 4}``
            (``quill.engine.spec_config``: n-gram prompt lookup, or a draft model sharing the target's tokenizer,
            loaded with these same options, its KV blocks out of the same budget).
            Greedy output is the same tokens as without it; sampled output has the same distribution.

    These keywords (all but model, skip_tokenizer_init, seed, progress, platform and engine_config) are
    ``quill.options.RunOptions``' fields: ``LLM(model, **options.llm_kwargs())`` runs ``options``.

    Every call runs on ``llm.engine`` (an ``EngineCore``: continuous batching over a paged KV cache
    with prefix caching), the same core ``quill serve`` drives.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str = "float32",
                 activation_quant: str = "auto", threads: int | None = None, kernel: str | None = None,
                 moe_backend: str | None = None,
                 skip_tokenizer_init: bool = False, max_model_len: int | None = None, seed: int = 0,
                 offline: bool = False, progress: bool | None = None, platform: Platform | None = None,
                 isa: str = "native",
                 engine_config: EngineConfig | None = None, kv_cache_dtype: str | None = None,
                 cache: bool | None = None, cache_dir: str | os.PathLike | None = None,
                 speculative_config: Mapping[str, Any] | str | None = None):
        # every option checked here, before the model loads (OptionError names the keyword)
        self.options = RunOptions(dtype=dtype, activation_quant=activation_quant, kv_cache_dtype=kv_cache_dtype,
                                  threads=threads, kernel=kernel, moe_backend=moe_backend, isa=isa,
                                  max_model_len=max_model_len, offline=offline, cache=cache, cache_dir=cache_dir,
                                  speculative_config=speculative_config)
        if kv_cache_dtype is not None:
            engine_config = dataclasses.replace(engine_config or EngineConfig(), kv_cache_dtype=kv_cache_dtype)
        if self.options.speculative_config is not None:
            engine_config = dataclasses.replace(engine_config or EngineConfig(),
                                                speculative=SpeculativeConfig.parse(self.options.speculative_config))
        self.platform = _limited(platform or detect(), isa)
        self.threads = self.options.threads or self.platform.default_threads
        # native kernels get the count explicitly (LoadContext); torch's own ops (attention over
        # prompts, norms on the torch path) only read the process-wide pool size
        torch.set_num_threads(self.threads)
        self.path = resolve_model(model, offline)
        spec = SpeculativeConfig.parse(self.options.speculative_config)
        draft_path = None
        if spec is not None and spec.method == "draft_model":  # its tokenizer checked before anything loads
            draft_path = resolve_model(spec.model, offline)
            check_same_tokenizer(self.path, draft_path)
        if progress is None:
            progress = _stderr_is_tty()
        # "auto" made concrete for this file: GGUF runs llama.cpp's arithmetic, the HF formats float
        self.activation: ActQuant = self.options.act_quant.resolve(is_gguf(self.path))
        ctx = LoadContext.create(self.platform, self.options.torch_dtype, self.activation.request,
                                 self.options.kernel, self.options.moe_backend, threads=self.threads)
        use_cache = cache_enabled() if cache is None else cache
        self.cache = PrepackedCache(cache_dir) if use_cache else None
        try:
            started = load_model(self.path, ctx, tokenizer=not skip_tokenizer_init, progress=progress,
                                 cache=self.cache)
        except KernelSelectionError as e:
            if self.options.act_quant is ActQuant.AUTO and not self.activation.is_float:
                # the user asked for a kernel, not for the format's default activations: say which to pass
                raise KernelSelectionError(f"{e} (int8-group activations are the default for GGUF files; "
                                           "activation_quant='none' / --act-quant none runs them in float)") from e
            raise
        self.loaded: LoadedModel = started.loaded
        self.cache_hit = started.cache_hit
        # the draft runs with the target's options (kernels, threads, activations, prepacked cache)
        self.draft = None if draft_path is None else load_model(draft_path, ctx, tokenizer=False, progress=progress,
                                                                 cache=self.cache).loaded.model
        self.model = self.loaded.model
        self.tokenizer = None if started.tokenizer is None else Tokenizer(started.tokenizer)
        self.eos_token_ids = (self.tokenizer.eos_token_ids if self.tokenizer is not None
                              else started.eos_token_ids)
        self.context_length = self.model.args.context_length
        if max_model_len is not None:
            self.context_length = min(self.context_length, max_model_len)
        # structured outputs compile against the tokenizer (xgrammar is imported at the first such request)
        grammars = None if self.tokenizer is None else GrammarCompiler(self.tokenizer, self.model.args.vocab_size,
                                                                        self.eos_token_ids)
        self.engine = EngineCore(self.model, self.eos_token_ids, self.context_length, engine_config, seed,
                                 isa=ctx.native_isa, grammars=grammars, draft=self.draft)
        self.arithmetic = self._arithmetic(engine_config)
        keep_step_memory()  # steps reuse their intermediates' pages instead of faulting them in again
        self.processor = OutputProcessor(self.engine, self.tokenizer)
        self._ids = itertools.count()

    def _arithmetic(self, engine_config: EngineConfig | None) -> dict[str, str]:
        """Which activation and KV-cache arithmetic runs and why (the CLI's load line, ``quill inspect``)."""
        # a float request with int8 layers: the checkpoint prescribes them (W8A8)
        prescribed = self.activation.is_float and any(
            i.summary.startswith("W") and "A8" in i.summary.split()[0] for i in self.loaded.layers)
        acts = describe_activations(self.options.act_quant, self.activation, is_gguf(self.path), prescribed)
        kv = describe_kv_cache(engine_config.kv_cache_dtype if engine_config else None, self.engine.kv_cache_dtype)
        out = {"activations": acts, "KV cache": kv}
        window = self.engine.blocks.window
        if window is not None:  # sliding-window layers: their own block group, freed as the window slides
            out["KV blocks"] = (f"{self.engine.blocks.num_blocks} for the global layers, {window.num_blocks} for "
                                f"the sliding-window layers (window {window.window}: blocks out of it are freed)")
        spec = self.engine.config.speculative
        if spec is not None:  # said only when asked for: on, or why not
            out["speculation"] = spec.describe() if self.engine.speculator is not None else (
                "off: the model keeps per-sequence recurrent state, which a rejected draft would corrupt")
            if self.engine.draft_cache is not None:
                e = self.engine
                out["speculation"] += (f"; KV budget split by bytes per token: target {e.cache.nbytes() >> 20} MiB, "
                                       f"draft {e.draft_cache.nbytes() >> 20} MiB ({e.blocks.num_blocks} blocks each)")
        return out

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The token ids that end generation (unless ``ignore_eos``); settable."""
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self._eos_token_ids = tuple(ids)
        engine = self.__dict__.get("engine")
        if engine is not None:
            engine.eos = frozenset(self._eos_token_ids)

    # ---- prompts -------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), check_prompt_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._encode(prompt["prompt"])
            raise GenerationError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', found keys {list(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise GenerationError("text prompts need a tokenizer, but this LLM was loaded with "
                                      "skip_tokenizer_init=True; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise GenerationError(f"a prompt should be text, a list of token ids or a dict, found {type(prompt).__name__}")

    def _prompts(self, prompts: Prompt | Sequence[Prompt]) -> list[tuple[str | None, list[int]]]:
        single = isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, Sequence) and bool(prompts) and all(isinstance(t, int) for t in prompts))
        items = [prompts] if single else list(prompts)
        if not items:
            raise GenerationError("no prompts given")
        return [self._encode(p) for p in items]

    def _params(self, params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        plist = [params] * n if isinstance(params, SamplingParams) else list(params)
        if len(plist) != n:
            raise GenerationError(f"{n} prompts but {len(plist)} SamplingParams")
        return plist

    # ---- generation (on the engine core) ----------------------------------------
    def _submit(self, prompts: Prompt | Sequence[Prompt], params,
                scores: Sequence[ScoreSpec | None] | None = None) -> list[RequestState]:
        encoded = self._prompts(prompts)
        plist = self._params(params, len(encoded))
        if any(p.stop_strings for p in plist) and self.tokenizer is None:
            raise GenerationError("stop strings need a tokenizer (this LLM has skip_tokenizer_init=True)")
        scores = scores or [None] * len(encoded)
        reqs = []
        try:
            for i, ((prompt, ids), p, sc) in enumerate(zip(encoded, plist, scores)):
                reqs.append(self.processor.add(f"llm-{next(self._ids)}", prompt, ids, p, label=f"prompt {i}",
                                               score=sc))
        except BaseException:
            for r in reqs:
                self.processor.abort(r.rid)
            raise
        return reqs

    def _events(self, reqs: list[RequestState]) -> Iterator[tuple[int, StreamChunk]]:
        """Step the engine until every request of ``reqs`` is done; abort the rest if the caller stops early."""
        index = {r.rid: i for i, r in enumerate(reqs)}
        try:
            while any(r.finish_reason is None for r in reqs):
                if not self.processor.has_work():
                    raise GenerationError("the engine stopped with requests unfinished")
                for state, chunk in self.processor.step():
                    i = index.get(state.rid)
                    if i is not None and (chunk.token_id is not None or chunk.error is not None):
                        yield i, chunk
        finally:
            for r in reqs:
                if r.finish_reason is None:
                    self.processor.abort(r.rid)

    def _outputs(self, reqs: list[RequestState]) -> list[RequestOutput]:
        outs = []
        for r in reqs:
            comp = CompletionOutput(0, r.text.text, list(r.token_ids),
                                    r.logprobs if r.params.logprobs is not None else None, r.finish_reason,
                                    r.stop_reason, r.error)
            outs.append(RequestOutput(r.prompt, r.prompt_ids, r.prompt_logprobs, [comp], r.timings))
        return outs

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt_token_ids": [...]}), batched continuously.

        Invalid input (a prompt, a ``SamplingParams`` field, a token id outside the vocabulary) raises
        ``GenerationError`` before anything runs.  A prompt that then fails inside the engine ends alone
        with ``finish_reason == "error"`` and ``outputs[0].error``; the others finish as usual."""
        reqs = self._submit(prompts, sampling_params)
        for _ in self._events(reqs):
            pass
        return self._outputs(reqs)

    def score(self, prompts: Sequence[Sequence[int]], specs: ScoreSpec | Sequence[ScoreSpec] | None = None,
              progress=None) -> list[PromptScores]:
        """Score the tokens of each prompt (lists of token ids), batched like ``generate``.

        For every prompt token from ``spec.first`` on: its log-probability given the tokens before it,
        the model's argmax there, and what the spec asks besides (top-k, log-probs at given ids).
        ``progress(n)`` is called with the number of prompt tokens of each request as it completes.
        """
        prompts = [check_prompt_ids(p) for p in prompts]
        if not prompts:
            raise GenerationError("no prompts given")
        specs = [ScoreSpec()] * len(prompts) if specs is None else (
            [specs] * len(prompts) if isinstance(specs, ScoreSpec) else list(specs))
        if len(specs) != len(prompts):
            raise GenerationError(f"{len(prompts)} prompts but {len(specs)} score specs")
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        reqs = self._submit([{"prompt_token_ids": p} for p in prompts], params, specs)
        for i, chunk in self._events(reqs):
            if progress is not None and chunk.finish_reason is not None:
                progress(len(reqs[i].prompt_ids))
        failed = [i for i, r in enumerate(reqs) if r.error is not None]
        if failed:
            raise RequestFailed(f"prompt {failed[0]} could not be scored: {reqs[failed[0]].error}")
        missing = [i for i, r in enumerate(reqs) if r.scores is None]
        if missing:
            raise GenerationError(f"prompt {missing[0]} could not be scored (the KV cache cannot hold it)")
        return [r.scores for r in reqs]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Generate for one prompt, yielding text pieces as they are decided (closing it aborts the request).

        A request that fails inside the engine raises ``RequestFailed`` after the pieces before it."""
        reqs = self._submit([prompt], sampling_params)
        for _, chunk in self._events(reqs):
            if chunk.error is not None:
                raise RequestFailed(chunk.error)
            yield chunk

    def chat_prompt(self, messages: Messages, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template; ``chat_template_kwargs``: more
        template variables (``{"enable_thinking": False}`` for Qwen3's), as transformers takes them."""
        if self.tokenizer is None:
            raise GenerationError("chat needs a tokenizer, but this LLM was loaded with skip_tokenizer_init=True")
        return self.tokenizer.encode_chat(messages, add_generation_prompt, template_kwargs=chat_template_kwargs)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Answer one conversation ([{"role", "content"}, ...]) or a list of them, via the chat template."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        return self.generate([{"prompt_token_ids": self.chat_prompt(c, chat_template_kwargs=chat_template_kwargs)}
                              for c in convs], sampling_params)

    def stream_chat(self, messages: Messages, sampling_params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Stream the answer to one conversation."""
        return self.stream({"prompt_token_ids": self.chat_prompt(messages)}, sampling_params)


def _stderr_is_tty() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()
