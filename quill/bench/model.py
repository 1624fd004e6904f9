"""Model-level benchmark: prefill, decode and batched decode of a whole checkpoint through ``quill.LLM``.

    quill bench model [CHECKPOINT] [--json out.json]

Without a checkpoint it writes the 1B Llama-shaped W4 checkpoint
(:func:`quill.bench.checkpoint.write_llama_w4`, every linear 4-bit including an untied
lm_head) to a cache directory once.  For each activation mode (W4A16: float activations;
W4A8: ``activation_quant="int8"``; W4A8g: ``"int8-group"``, one scale per token and weight group)
it measures, as medians of several runs:

* prefill tokens/s of a ``prompt``-token prompt,
* decode tokens/s at batch 1 (``gen`` tokens after that prompt),
* batch throughput: ``batch`` prompts decoded together (generated tokens/s, all rows).

Decode is compared with the roofline: the bytes one decoded token reads (every linear's
weights as stored, lm_head included, plus the KV cache read by attention, averaged over
the decoded positions) divided by the DRAM read bandwidth.  On a shared host that
bandwidth moves by 2x within seconds; the roofline is the highest all-thread read any probe
of the run measured (quill's streaming read and torch.sum, before and after everything, and
before and after every decode run), named in the report, so a low probe never flatters the
decode.  The probes around each run are reported beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import quill
from quill.bench import memory, settled
from quill.engine.core import EngineConfig
from quill.errors import GenerationError
from quill.platform import Platform

MODES = {"w4a16": "none", "w4a8": "int8", "w4a8g": "int8-group"}  # label -> activation_quant


@dataclass
class ModeResult:
    """One activation mode: medians over the runs, and what one decoded token reads."""

    mode: str
    kernels: dict[str, int]  # kernel -> linear layers it runs
    prefill_tps: float
    decode_tps: float
    batch_tps: float
    weight_bytes_per_token: int  # every linear read once per decoded token, as stored (lm_head included)
    kv_bytes_per_token: int  # the KV cache attention reads, averaged over the decoded positions
    samples: dict[str, list[float]] = field(default_factory=dict)  # per run; "dram_gbs": probes around each decode

    def roofline_fractions(self, peak_gbs: float) -> list[float]:
        """Per decode run: achieved bytes/s over the run's highest read bandwidth ``peak_gbs``."""
        return [self.bytes_per_token * tps / (peak_gbs * 1e9) for tps in self.samples["decode_tps"]]

    @property
    def dram_gbs(self) -> float:
        """Median of the probes around the decode runs (the higher of before / after each)."""
        return statistics.median(self.samples["dram_gbs"])

    @property
    def bytes_per_token(self) -> int:
        return self.weight_bytes_per_token + self.kv_bytes_per_token

    @property
    def decode_gbs(self) -> float:
        return self.bytes_per_token * self.decode_tps / 1e9


def linear_bytes(llm: quill.LLM) -> int:
    """Bytes of every linear as stored; a tied lm_head reads the embedding's bytes."""
    layers = {i.name: i for i in llm.loaded.layers}
    total = sum(i.weight_bytes for i in layers.values() if i.kind in ("quantized", "dense", "expert"))
    if "lm_head" in layers and layers["lm_head"].kind == "tied":
        total += layers["model.embed_tokens"].weight_bytes
    return total


def kv_bytes(llm: quill.LLM, prompt: int, gen: int) -> int:
    """Bytes of K and V attention reads per decoded token, averaged over positions prompt .. prompt + gen - 1."""
    a = llm.model.args
    per_position = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * llm.loaded.dtype.itemsize
    return int(per_position * (prompt + (gen - 1) / 2))


def _kernels(llm: quill.LLM) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in llm.loaded.layers:
        if i.kind in ("quantized", "dense", "tied", "expert"):
            out[i.kernel] = out.get(i.kernel, 0) + 1
    return out


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def _batched_decode_tps(llm, prompts: list[list[int]], params) -> float:
    """Tokens/s of the steps in which every row decodes (each row had its first token before the step
    and none had finished).  Timed over the whole request instead, the rows that start early would
    count the later rows' prompt chunks as decode time.  Steps the engine directly (its processor),
    as ``LLM.generate`` does."""
    reqs = llm._submit(prompts, params)
    row = {r.rid: i for i, r in enumerate(reqs)}
    counts = [0] * len(reqs)
    tokens, seconds, done = 0, 0.0, False
    last = time.perf_counter()
    while any(r.finish_reason is None for r in reqs):
        all_decoding = min(counts) >= 1 and not done
        made = 0
        for state, chunk in llm.processor.step():
            if state.rid in row and chunk.token_id is not None:
                counts[row[state.rid]] += 1
                made += 1
                done = done or chunk.finish_reason is not None
        now = time.perf_counter()
        if all_decoding:
            tokens, seconds = tokens + made, seconds + now - last
        last = now
    if not seconds:
        raise GenerationError("the batch never decoded all its rows at once")
    return tokens / seconds


def run_mode(path: Path, mode: str, dtype: str, threads: int, prompt: int, gen: int, batch: int,
             runs: int, probe: memory.Probe, log: Callable[[str], None]) -> ModeResult:
    # no prefix cache: every run repeats the same prompt, whose prefill must be computed each time
    llm = settled(quill.LLM(str(path), dtype=dtype, activation_quant=MODES[mode], threads=threads,
                            skip_tokenizer_init=True, progress=False,
                            engine_config=EngineConfig(enable_prefix_caching=False)))
    vocab = llm.model.args.vocab_size
    params = quill.SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    single = _prompts(1, prompt, vocab, 0)
    group = _prompts(batch, min(prompt, 128), vocab, 1)
    llm.generate(_prompts(1, 16, vocab, 2), quill.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    samples: dict[str, list[float]] = {"prefill_tps": [], "decode_tps": [], "batch_tps": [], "dram_gbs": []}
    for r in range(runs):
        before = probe.read_gbs()
        t = llm.generate(single, params)[0].timings
        samples["dram_gbs"].append(max(before, probe.read_gbs()))
        samples["prefill_tps"].append(t.prefill_tps)
        samples["decode_tps"].append(t.decode_tps)
        start = time.perf_counter()
        samples["batch_tps"].append(_batched_decode_tps(llm, group, params))
        spent = time.perf_counter() - start
        log(f"  {mode} run {r + 1}/{runs}: prefill {t.prefill_tps:.1f} tok/s, decode {t.decode_tps:.2f} tok/s "
            f"(DRAM read around it {samples['dram_gbs'][-1]:.1f} GB/s), batch {batch}: "
            f"{samples['batch_tps'][-1]:.1f} tok/s ({spent:.1f} s)")
    res = ModeResult(mode, _kernels(llm), *(statistics.median(samples[k]) for k in
                                             ("prefill_tps", "decode_tps", "batch_tps")),
                     linear_bytes(llm), kv_bytes(llm, prompt, gen), samples)
    del llm
    return res


@dataclass
class ModelBench:
    checkpoint: str
    dtype: str
    threads: int
    prompt: int
    gen: int
    batch: int
    runs: int
    bandwidth_before: memory.Bandwidth
    bandwidth_after: memory.Bandwidth
    results: list[ModeResult]

    def peak(self) -> tuple[float, str]:
        """The highest all-thread read of any probe in the run, and which probe: the roofline."""
        probes = []
        for when, b in (("before the run", self.bandwidth_before), ("after the run", self.bandwidth_after)):
            probes.append((b.torch_sum_all, f"torch.sum {when}"))
            if b.native_all is not None:
                probes.append((b.native_all, f"quill's streaming read {when}"))
        for r in self.results:
            probes += [(g, f"quill's streaming read around {r.mode} decode run {i + 1}")
                       for i, g in enumerate(r.samples["dram_gbs"])]
        return max(probes, key=lambda t: t[0])

    def roofline_tps(self, r: ModeResult) -> float:
        """Decode tokens/s at the run's highest read bandwidth."""
        return self.peak()[0] * 1e9 / r.bytes_per_token

    def pct_of_roofline(self, r: ModeResult) -> float:
        return 100 * statistics.median(r.roofline_fractions(self.peak()[0]))

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("results", "bandwidth_before", "bandwidth_after")}
        out["dram_read_gbs"] = {"before": asdict(self.bandwidth_before), "after": asdict(self.bandwidth_after),
                                "roofline": round(self.peak()[0], 2), "roofline_probe": self.peak()[1]}
        out["modes"] = [{**asdict(r), "bytes_per_token": r.bytes_per_token, "decode_gbs": round(r.decode_gbs, 2),
                         "dram_gbs_around_decode": round(r.dram_gbs, 2), "roofline_tps": round(self.roofline_tps(r), 2),
                         "pct_of_roofline_per_run": [round(100 * f, 1) for f in r.roofline_fractions(self.peak()[0])],
                         "pct_of_roofline": round(self.pct_of_roofline(r), 1)}
                        for r in self.results]
        return out

    def table(self) -> str:
        lines = [f"{self.checkpoint} ({self.dtype}, {self.threads} threads): DRAM read "
                 f"{self.bandwidth_before.best_all:.1f} GB/s before, {self.bandwidth_after.best_all:.1f} after",
                 f"{'mode':<6} {'prefill tok/s':>13} {'decode tok/s':>12} {'batch tok/s':>11} "
                 f"{'MB/token':>8} {'GB/s':>6} {'DRAM':>6} {'roofline':>8} {'%':>5}"]
        for r in self.results:
            lines.append(f"{r.mode:<6} {r.prefill_tps:13.1f} {r.decode_tps:12.2f} {r.batch_tps:11.1f} "
                         f"{r.bytes_per_token / 1e6:8.1f} {r.decode_gbs:6.1f} {r.dram_gbs:6.1f} "
                         f"{self.roofline_tps(r):8.1f} {self.pct_of_roofline(r):5.1f}")
        lines.append("DRAM: median read bandwidth probed around the decode runs; roofline and %: against the "
                     f"highest read of any probe in the run, {self.peak()[0]:.1f} GB/s ({self.peak()[1]})")
        return "\n".join(lines)


def run(path: Path, platform: Platform, modes: list[str], dtype: str = "float32", threads: int | None = None,
        prompt: int = 512, gen: int = 128, batch: int = 8, runs: int = 5,
        log: Callable[[str], None] = print) -> ModelBench:
    threads = threads or platform.default_threads
    l3 = platform.cache("L3") or (32 << 20)
    before = memory.measure(l3, threads)
    log(f"DRAM read before: {before.best_all:.1f} GB/s")
    probe = memory.Probe(l3, threads)
    results = [run_mode(path, m, dtype, threads, prompt, gen, batch, runs, probe, log) for m in modes]
    del probe
    after = memory.measure(l3, threads)
    log(f"DRAM read after: {after.best_all:.1f} GB/s")
    return ModelBench(str(path), dtype, threads, prompt, gen, batch, runs, before, after, results)
