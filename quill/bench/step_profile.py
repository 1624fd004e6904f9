"""Where a decode step's time goes: the native step's ops (csrc/step_prof.h counters) and the Python
around it (embedding, the step call and its state copies, final norm and lm_head, sampling and the
engine's bookkeeping), per token, with the bytes each op kind reads and the GB/s it reaches.

    QUILL_STEP_PROFILE=1 python -m quill.bench.step_profile FILE.gguf [FILE ...] [--act-quant int8-group]
        [--prompt 128] [--gen 64] [--threads 2] [--isa avx2] [--json OUT]

Bytes are what the loaded kernels hold (``LayerInfo.held_bytes``): a routed expert's share is its stack's
stored bytes times top_k / experts (one token reads k of them); a DeltaNet layer's state is read and written
once per token.  The op kinds of the native step are those of ``step_prof.h``; ``prepare`` is every
linear's activation quantization and the barrier after it.  One process, one model at a time; the DRAM
probe is read before each file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

# LayerInfo name patterns -> the native step's op kinds (step_prof.h), plus the Python-side lm_head
KINDS = [
    (r"linear_attn\.in_proj", "dn_in_proj"), (r"linear_attn\.out_proj", "dn_out_proj"),
    (r"self_attn\.[qkv]_proj", "attn_qkv"), (r"self_attn\.o_proj", "attn_o_proj"),
    (r"shared_expert_gate", "shared_gate"), (r"shared_expert\.(gate|up)_proj", "shared_gate_up"),
    (r"shared_expert\.down_proj", "shared_down"), (r"mlp\.experts", "moe_experts"), (r"mlp\.gate$", "moe_router"),
    (r"mlp\.(gate|up)_proj", "mlp_gate_up"), (r"mlp\.down_proj", "mlp_down"), (r"lm_head", "lm_head"),
]


def kind_of(name: str) -> str | None:
    return next((k for pat, k in KINDS if re.search(pat, name)), None)


def op_bytes(llm) -> dict[str, float]:
    """Bytes a decoded token reads per op kind (weights as held; a routed expert's k / E share; DeltaNet state)."""
    model, out = llm.model, defaultdict(float)
    args = model.args
    experts, top_k = getattr(args, "num_experts", 0), getattr(args, "num_experts_per_tok", 0)
    for info in llm.loaded.layers:
        kind = kind_of(info.name) if info.kind != "embedding" else None
        if kind is None:
            continue
        if info.kind == "expert":
            out[kind] += info.weight_bytes * top_k / max(experts, 1)
        else:
            out[kind] += info.held_bytes or info.weight_bytes
    for spec in model.state_specs() or []:  # None: every layer keeps keys and values
        if spec is not None:  # read once and written once per token
            out["dn_heads"] += 2 * sum(4 * _numel(s) for s in spec.shapes[1:])
            out["dn_conv"] += 2 * 4 * _numel(spec.shapes[0])
    return dict(out)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Timed:
    """Wraps ``fn`` to add its wall time to ``acc[name]``."""

    def __init__(self, fn, acc: dict, name: str):
        self.fn, self.acc, self.name = fn, acc, name

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.acc[self.name] += time.perf_counter() - t


class _Handle:
    """The C++ DecoderStep with its forward timed (the rest of NativeDecodeStep.__call__ is its state copies)."""

    def __init__(self, handle, acc: dict):
        self._h, self.forward = handle, _Timed(handle.forward, acc, "native step")

    def __getattr__(self, name):
        return getattr(self._h, name)


def profile_file(path: Path, act_quant: str, prompt: int, gen: int, threads: int, isa: str = "native") -> dict:
    import quill
    from quill import native
    from quill.bench import settled
    from quill.bench.llamacpp import prompt_ids
    from quill.engine.core import EngineConfig

    ext = native.load().module
    # settled: a prepacked-cache miss writes the cache file on a thread, which a profile would measure too
    llm = settled(quill.LLM(str(path), threads=threads, progress=False, activation_quant=act_quant, isa=isa,
                            engine_config=EngineConfig(enable_prefix_caching=False)))
    eng, model = llm.engine, llm.model
    if eng.native_step is None:
        raise RuntimeError(f"{path.name}: no native decode step ({eng.native_step_reason})")
    params = quill.SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    llm.generate([prompt_ids(8)], quill.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    py: dict[str, float] = defaultdict(float)
    steps: list[dict] = []
    step_fn = eng.step

    def step():
        before, t = dict(py), time.perf_counter()
        out = step_fn()
        py["engine step"] += time.perf_counter() - t
        steps.append({k: py[k] - before.get(k, 0.0) for k in py})
        return out

    eng.step = step
    eng.native_step.handle = _Handle(eng.native_step.handle, py)
    eng.native_step = _Timed(eng.native_step, py, "native step call")  # (the engine only calls it)
    model.model.embed_tokens.forward = _Timed(model.model.embed_tokens.forward, py, "embedding")
    model.model.norm.forward = _Timed(model.model.norm.forward, py, "final norm")
    model.lm_head.forward = _Timed(model.lm_head.forward, py, "lm_head")
    ext.step_profile_enable(True)
    ext.step_profile(True)
    llm.generate([prompt_ids(prompt)], params)
    prof = ext.step_profile(True)
    ext.step_profile_enable(False)
    decode = [s for s in steps if s.get("native step", 0.0) > 0]  # the prefill step runs the Python layers
    n = len(decode)
    tot = {k: sum(s.get(k, 0.0) for s in decode) / n for k in ("engine step", "native step call", "native step",
                                                                   "embedding", "final norm", "lm_head")}
    nsteps = prof.pop("steps")
    ops = {k: v / nsteps for k, v in prof.items() if v > 0}
    byt = op_bytes(llm)
    rows = {f"step: {k}": (v, byt.get(k, 0.0)) for k, v in ops.items()}
    rows["step: (outside the ops)"] = (tot["native step"] - sum(ops.values()), 0.0)
    rows["python: state copies"] = (tot["native step call"] - tot["native step"], 0.0)
    rows["python: embedding"] = (tot["embedding"], 0.0)
    rows["python: final norm"] = (tot["final norm"], 0.0)
    rows["python: lm_head"] = (tot["lm_head"], byt.get("lm_head", 0.0))
    rows["python: sampling, engine"] = (tot["engine step"] - tot["native step call"] - tot["embedding"]
                                        - tot["final norm"] - tot["lm_head"], 0.0)
    return {"file": str(path), "act_quant": act_quant, "tokens": n, "ms_per_token": tot["engine step"] * 1e3,
            "rows": {k: {"ms": t * 1e3, "mb": b / 1e6, "gbs": b / t / 1e9 if t > 0 and b else None}
                     for k, (t, b) in rows.items()}}


def table(r: dict) -> str:
    total = r["ms_per_token"]
    lines = [f"{Path(r['file']).name} ({r['act_quant']}, {r.get('isa', 'native')}): {total:.2f} ms per token over "
             f"{r['tokens']} tokens ({1e3 / total:.2f} tok/s)",
             "| op | ms/token | % | MB/token | GB/s |", "|---|---|---|---|---|"]
    for k, v in sorted(r["rows"].items(), key=lambda kv: -kv[1]["ms"]):
        gbs = f"{v['gbs']:.1f}" if v["gbs"] else ""
        mb = f"{v['mb']:.1f}" if v["mb"] else ""
        lines.append(f"| {k} | {v['ms']:.2f} | {100 * v['ms'] / total:.1f} | {mb} | {gbs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--act-quant", default="int8-group")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native", help="quill's (and torch's) ISA")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.isa == "avx2":  # before torch is imported
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    from quill.bench import memory
    from quill.platform import detect

    probe = memory.Probe(detect().cache("L3") or (32 << 20), args.threads)
    results = []
    for f in args.files:
        dram = probe.read_gbs()
        r = profile_file(f, args.act_quant, args.prompt, args.gen, args.threads, args.isa)
        r["dram_gbs"], r["isa"] = dram, args.isa
        results.append(r)
        print(f"DRAM probe {dram:.1f} GB/s")
        print(table(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
