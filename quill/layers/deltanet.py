"""Gated DeltaNet: linear attention whose per-sequence state is a matrix updated by the gated delta rule.

Per token t and value head h (Qwen3.5's ``linear_attn``; transformers' ``Qwen3_5GatedDeltaNet``):

    q, k, v   = silu(causal depthwise conv1d over time of in_proj_qkv(x))   (kernel K, its last K-1 inputs kept)
    q, k      = l2norm(q), l2norm(k); q /= sqrt(Dk); a key head serves Hv / Hk consecutive value heads
    g         = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   (log decay, <= 0)
    beta      = sigmoid(in_proj_b(x))
    S         = exp(g) * S;  S += k (beta * (v - k^T S));  o = q^T S        (S [Dk, Dv] per head)
    out       = out_proj(rmsnorm(o) * silu(in_proj_z(x)))

A prompt runs the chunked form (chunks of ``CHUNK`` positions: the intra-chunk updates solved as one
triangular system, then one state update per chunk), a decode token one recurrent step.  Both read
and write the state through a :class:`StateView` (the engine's per-sequence pools), or start from zero
without one.  Decode tokens of a float32 model run the native update (quill.kernels.deltanet: conv step,
delta rule and gated norm in one call, on the ISA chosen at load); otherwise torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from quill.errors import CheckpointError
from quill.kernels import deltanet as native_deltanet
from quill.layers.context import LoadContext
from quill.layers.merged import merged
from quill.layers.slots import RMSNorm, Slot, checked, linear

CHUNK = 64  # positions per chunk of the prefill form (as the reference implementations)


@dataclass(frozen=True)
class StateSpec:
    """The per-sequence state one layer keeps between steps: one tensor per shape, of ``dtype``."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype = torch.float32

    def nbytes(self) -> int:
        size = torch.empty(0, dtype=self.dtype).element_size()
        return sum(size * torch.Size(s).numel() for s in self.shapes)


class StateView(Protocol):
    """One layer's per-sequence state for one step (the engine's ``quill.engine.state_cache``)."""

    segments: list[tuple[int, int]]  # (start in the packed row, new tokens) of each sequence, packed order

    def read(self, seqs: list[int]) -> list[torch.Tensor]:
        """The states of sequences ``seqs`` (indices into ``segments``): per state tensor [len(seqs), *shape]."""

    def write(self, seqs: list[int], states: list[torch.Tensor]) -> None:
        """Their new states (kept by the engine once the whole forward succeeded)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, T, C], weight [C, K], state [N, C, K-1] (the previous K-1 inputs) -> silu(conv) [N, T, C], new state."""
    full = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=-1)  # [N, C, K-1+T]
    out = F.conv1d(full, weight[:, None, :].to(full.dtype), groups=weight.shape[0])  # [N, C, T]
    return F.silu(out).transpose(1, 2).to(x.dtype), full[:, :, -state.shape[-1]:].clone()


def recurrent_step(q, k, v, g, beta, state):
    """One token per sequence: q, k [N, H, Dk] (normalised, scaled), v [N, H, Dv], g, beta [N, H],
    state [N, H, Dk, Dv] -> o [N, H, Dv], new state."""
    state = state * g.exp()[..., None, None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]  # [N, H, Dv]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The whole of T at once, chunk by chunk: q, k [N, H, T, Dk] (normalised, scaled), v [N, H, T, Dv],
    g, beta [N, H, T], state [N, H, Dk, Dv] -> o [N, H, T, Dv], new state.  The same math as T recurrent
    steps (transformers' ``torch_chunk_gated_delta_rule``), in matrix products."""
    N, H, T, Dk = k.shape
    pad = (-T) % chunk
    # padded positions have k = v = 0 and g = 0: they change neither the outputs kept nor the state
    q, k, v = (F.pad(t, (0, 0, 0, pad)).reshape(N, H, -1, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)).reshape(N, H, -1, chunk) for t in (g, beta))
    cum = g.cumsum(-1)  # [N, H, C, L]: log decay from the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [.., L, L]
    kb, vb = k * beta[..., None], v * beta[..., None]
    # (I + strictly-lower(beta k k^T * decay)) u = beta v: the chunk's delta-rule corrections, solved at once
    lhs = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, dtype=q.dtype)
    new_v = torch.linalg.solve_triangular(lhs, vb, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(lhs, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [.., L, L], causal incl. diagonal
    q_decayed = q * cum.exp()[..., None]
    k_tail = k * (cum[..., -1:] - cum).exp()[..., None]  # decay from each position to the chunk's end
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_v)
    for c in range(q.shape[2]):
        u = new_v[:, :, c] - k_decayed[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + intra[:, :, c] @ u
        state = state * chunk_decay[:, :, c] + k_tail[:, :, c].transpose(-1, -2) @ u
    return out.reshape(N, H, -1, v.shape[-1])[:, :, :T], state


class Conv1dWeight(nn.Module, Slot):
    """A depthwise conv1d's weight, [channels, 1, kernel] as HF stores it; held as [channels, kernel]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.channels, self.kernel = channels, kernel
        self.weight: torch.Tensor | None = None

    @property
    def filled(self) -> bool:
        return self.weight is not None

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr != "weight":
            return False
        w = checked(ctx, f"{name}.weight", tensor, (self.channels, 1, self.kernel))
        self.weight = w[:, 0].to(torch.float32)
        return True

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        return {}, {"weight": self.weight}

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        self.weight = checked(ctx, f"{name}.weight", tensors["weight"], (self.channels, self.kernel))


class GatedRMSNorm(RMSNorm):
    """rmsnorm(x) * weight * silu(z), in float32 (transformers' ``Qwen3_5RMSNormGated``)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * F.silu(z.float()).to(x.dtype)


@dataclass(frozen=True)
class DeltaNetDims:
    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float
    tiled: bool = False  # value head h reads key head h % Hk (llama.cpp's order), else h // (Hv / Hk) (HF's)

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


class GatedDeltaNet(nn.Module, Slot):
    """The ``linear_attn`` module: its projections, conv, norm and the per-head ``A_log`` / ``dt_bias``
    (this slot's own tensors) -> ``forward(x, state)``."""

    PARAMS = ("A_log", "dt_bias")

    def __init__(self, d: DeltaNetDims):
        super().__init__()
        self.d = d
        kd, vd = d.key_heads * d.key_dim, d.value_heads * d.value_dim
        self.in_proj_qkv = linear(d.hidden, 2 * kd + vd)
        self.in_proj_z = linear(d.hidden, vd)
        self.in_proj_b = linear(d.hidden, d.value_heads)
        self.in_proj_a = linear(d.hidden, d.value_heads)
        self.proj = merged(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)  # one kernel call
        self.conv1d = Conv1dWeight(d.conv_channels, d.conv_kernel)
        self.norm = GatedRMSNorm(d.value_dim, d.eps)
        self.out_proj = linear(vd, d.hidden)
        self.params: dict[str, torch.Tensor] = {}
        self.isa: str | None = None  # the native variant decode tokens run (chosen at load), None: torch

    def state_spec(self) -> StateSpec:
        d = self.d
        return StateSpec(((d.conv_channels, d.conv_kernel - 1), (d.value_heads, d.key_dim, d.value_dim)))

    # ---- the slot: A_log and dt_bias --------------------------------------------
    @property
    def filled(self) -> bool:
        return all(p in self.params for p in self.PARAMS)

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr not in self.PARAMS:
            return False
        self.params[attr] = checked(ctx, f"{name}.{attr}", tensor, (self.d.value_heads,)).to(torch.float32)
        self.isa = ctx.native_isa
        return True

    def check_filled(self, name: str, ctx: LoadContext) -> None:
        missing = [f"{name}.{p}" for p in self.PARAMS if p not in self.params]
        if missing:
            raise CheckpointError(f"{ctx.where}: the checkpoint has no tensor for '{missing[0]}' "
                                  f"(a Gated DeltaNet layer needs {', '.join(self.PARAMS)})")

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        return {}, dict(self.params)

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        self.params = {p: checked(ctx, f"{name}.{p}", tensors[p], (self.d.value_heads,)) for p in self.PARAMS}
        self.isa = ctx.native_isa

    # ---- the math ----------------------------------------------------------------------
    def forward(self, x: torch.Tensor, state: StateView | None) -> torch.Tensor:
        """x [B, T, E] -> [B, T, E].  Without ``state`` every row is a whole sequence from a zero state;
        with it, x is the engine's packed row (B = 1) and ``state.segments`` says whose tokens are where."""
        B, T, _ = x.shape
        d = self.d
        qkv, z, b, a = self.proj(x)
        g = -self.params["A_log"].exp() * F.softplus(a.float() + self.params["dt_bias"])  # [B, T, Hv]
        beta = torch.sigmoid(b.float())
        done = None  # (packed rows, their gated-normed outputs) the native decode update gave
        if state is None:
            o, _ = self._mix(qkv, g, beta, self._zeros(B))
        else:
            o = torch.zeros(T, d.value_heads, d.value_dim, dtype=torch.float32)
            done = self._native_decodes(qkv[0], z[0], a[0], b[0], state)
            self._by_sequence(qkv[0], g[0], beta[0], state, o, skip=done is not None)
            o = o[None]
        out = self.norm(o.to(x.dtype), z.reshape(B, T, d.value_heads, d.value_dim))
        if done is not None:
            out[0, done[0]] = done[1].view(-1, d.value_heads, d.value_dim).to(out.dtype)
        return self.out_proj(out.reshape(B, T, -1))

    def _native_decodes(self, qkv, z, a, b, state: StateView) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The packed row's decode tokens through the native update, or None (none, or it cannot run them)."""
        decodes = [i for i, (_, n) in enumerate(state.segments) if n == 1]
        if not decodes or self.isa is None:
            return None
        rows = torch.tensor([state.segments[i][0] for i in decodes])
        # copies, updated in place, then staged: the engine keeps them once the whole step succeeded
        conv, s = (t.contiguous() for t in state.read(decodes))
        out = native_deltanet.decode(qkv[rows], z[rows], a[rows], b[rows], self.conv1d.weight, self.params["A_log"],
                                     self.params["dt_bias"], self.norm.weight, self.norm.eps, conv, s, self.isa,
                                     tiled=self.d.tiled)
        if out is None:
            return None
        state.write(decodes, [conv, s])
        return rows, out

    def _zeros(self, n: int) -> list[torch.Tensor]:
        return [torch.zeros(n, *s) for s in self.state_spec().shapes]

    def _by_sequence(self, qkv, g, beta, state: StateView, o: torch.Tensor, skip: bool = False) -> None:
        """The packed row's decode tokens in one recurrent step (unless ``skip``: the native update ran them),
        each prompt chunk in the chunked form."""
        decodes = [i for i, (_, n) in enumerate(state.segments) if n == 1]
        if decodes and not skip:
            rows = torch.tensor([state.segments[i][0] for i in decodes])
            out, new = self._mix(qkv[rows][:, None], g[rows][:, None], beta[rows][:, None], state.read(decodes))
            o[rows] = out[:, 0]
            state.write(decodes, new)
        for i, (start, n) in enumerate(state.segments):
            if n > 1:
                sl = slice(start, start + n)
                out, new = self._mix(qkv[None, sl], g[None, sl], beta[None, sl], state.read([i]))
                o[sl] = out[0]
                state.write([i], new)

    def _mix(self, qkv, g, beta, states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """qkv [N, T, C], g and beta [N, T, Hv], (conv, delta-rule) states -> o [N, T, Hv, Dv] float32, new states."""
        d = self.d
        N, T, _ = qkv.shape
        mixed, conv = causal_conv(qkv.float(), self.conv1d.weight, states[0])
        kd = d.key_heads * d.key_dim
        q, k, v = mixed.split([kd, kd, d.value_heads * d.value_dim], dim=-1)
        rep = d.value_heads // d.key_heads
        def per_value_head(t):  # [N, T, Hk, Dk] -> [N, T, Hv, Dk]
            t = l2norm(t.reshape(N, T, d.key_heads, d.key_dim))
            return t.repeat(1, 1, rep, 1) if d.tiled else t.repeat_interleave(rep, 2)
        q, k = per_value_head(q) * d.key_dim ** -0.5, per_value_head(k)
        v = v.reshape(N, T, d.value_heads, d.value_dim)
        if T == 1:
            o, s = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], states[1])
            return o[:, None], [conv, s]
        o, s = chunked_delta_rule(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), states[1])
        return o.transpose(1, 2), [conv, s]
