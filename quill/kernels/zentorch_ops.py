"""zentorch (AMD's ZenDNN plugin for PyTorch, ``pip install 'quill[zen]'``) as a linear kernel.

Two kernels, both through zentorch 2.13's eager ops:

* ``zentorch_woq`` (**W4A16**), ``zentorch_woq_linear``: 4-bit codes packed by
  ``zentorch_woq_repack_weight`` ([N, K] one nibble per int8 -> int32 [N, K/8],
  passed transposed as [K/8, N]);
  scales float32 [G, N].  Symmetric weights go in as signed nibbles ``codes - 8``
  with no zero points (``w = s4 * s``); integer zero points as unsigned nibbles with
  int8 zero points (``w = (q - z) * s``), both exact.  GGUF Q4_1-style offsets use
  zendnnl's bfloat16 zero point, which it reads the way ATen's int4pack does,
  ``w = (q - 8) * s + z``: ``z = (8 - zero) * s + offset`` rounded to bfloat16.
  zendnnl's weight-only GEMM takes bfloat16 activations only, so inputs are
  rounded to bfloat16 and the result comes back in bfloat16 (about 52 dB SQNR
  against the float32 reference).
* ``zentorch`` (**W8A8**), ``zentorch_qlinear``: int8 x int8 (VNNI) GEMM on
  symmetric per-channel int8 weights.  Activations are quantized by :mod:`quill.kernels.activation` (the
  reference's own arithmetic, per token or per tensor, symmetric or not) and passed
  as int8 with input scale 1, so zentorch returns ``acc[m, n] * w_scale[n]``; the
  per-row activation scale and zero point are applied here.  This is exact up to
  float32 rounding.  (zentorch's own ``zentorch_dynamic_qlinear`` is not used: it
  quantizes activations with ``amax / 127``, not the ``amax / 127.5`` that
  compressed-tensors checkpoints are calibrated with; measured 42 dB against
  quill's reference versus 134 dB against an ``amax / 127`` emulation.)

``zentorch`` is in the priority lists ahead of ``torch`` (whose W8A8 path only
emulates int8: on the development Zen 4, 4096x4096, one thread, 0.85 vs 1.5 ms
at M=1 and 6.3 vs 32 ms at M=64); ``zentorch_woq`` is registered but listed
nowhere (see :class:`ZentorchWoqKernel`).

Things zentorch does that this module guards against:

* It needs what its own ``is_avx512_supported()`` checks: AVX-512 F, BW, VL, DQ,
  VNNI and BF16.  ``zentorch_qlinear`` refuses at run time without them and
  zentorch's graph passes emit none of its ops there; both kernels' ``supported``
  refuse from the :class:`Platform` before zentorch is even imported.
* zendnnl prints warnings and errors to stdout through its own logger (read at
  the first op call).  Loading this kernel sets ``ZENDNNL_*_LOG_LEVEL=0`` unless
  the user set them; failures still raise ``RuntimeError``, and ``can_implement``
  keeps every call inside the ops' documented limits.
* zendnnl caches reordered weights keyed by the weight's *address* (and shape)
  for the life of the process.  A new weight allocated where a freed one lived
  silently reuses the stale entry (measured: wrong results in 20-50 % of a sweep
  that freed and re-created layers; ``zentorch._C.clear_weight_cache()`` did not
  fix it).  Every tensor handed to zentorch is therefore pinned for the life of
  the process (``_PINNED``): memory of zentorch layers is never returned.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import warnings
from abc import abstractmethod
from dataclasses import dataclass
from types import ModuleType

import torch

from quill.canonical import ActivationQuant, QuantizedWeight
from quill.errors import KernelError
from quill.kernels.act_order import contiguous_groups
from quill.kernels.activation import quantize_activations
from quill.kernels.base import LinearKernel
from quill.kernels.config import ActKind, LinearLayerConfig
from quill.platform import Platform

log = logging.getLogger("quill.kernels")

# What zentorch._C.is_avx512_supported() requires (zentorch src/cpu/cpp/Utils.hpp).
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")
REQUIRED_OPS = ("zentorch_woq_linear", "zentorch_woq_repack_weight", "zentorch_qlinear")
_LOG_LEVEL_VARS = ("ZENDNNL_COMMON_LOG_LEVEL", "ZENDNNL_API_LOG_LEVEL", "ZENDNNL_TEST_LOG_LEVEL",
                   "ZENDNNL_DEBUG_LOG_LEVEL", "ZENDNNL_PROFILE_LOG_LEVEL")
_WOQ_PACK = 8  # zentorch_woq_repack_weight packs 8 nibbles per int32 along K

# Tensors whose addresses zendnnl's process-wide caches may hold (see the module docstring).
_PINNED: list[tuple[torch.Tensor, ...]] = []


@contextlib.contextmanager
def _captured_output():
    """Send file descriptors 1 and 2 (where C libraries print) to a temporary file.

    Yields a list that holds the captured text once the block has exited.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    captured: list[str] = []
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as tmp:
        try:
            os.dup2(tmp.fileno(), 1)
            os.dup2(tmp.fileno(), 2)
            yield captured
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            tmp.seek(0)
            captured.append(tmp.read().decode(errors="replace").strip())


@functools.lru_cache(maxsize=1)
def load_zentorch() -> tuple[ModuleType | None, str | None]:
    """(zentorch module, None), or (None, why it cannot be used).  Imports at most once, quietly."""
    if importlib.util.find_spec("zentorch") is None:
        return None, "zentorch is not installed (pip install 'quill[zen]')"
    for var in _LOG_LEVEL_VARS:  # zendnnl reads these at its first op call; the user's own values win
        os.environ.setdefault(var, "0")
    with _captured_output() as out, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            module = importlib.import_module("zentorch")
        except (ImportError, OSError, RuntimeError) as e:
            module, reason = None, f"zentorch failed to import: {type(e).__name__}: {e}"
        else:
            reason = None
    noise = out[0]
    if noise or caught:
        log.debug("zentorch import printed %r, warned %s", noise, [str(w.message) for w in caught])
    if module is None:
        return None, reason
    missing = [op for op in REQUIRED_OPS if not hasattr(torch.ops.zentorch, op)]
    if missing:
        version = getattr(module, "__version__", "?")
        return None, f"zentorch {version} does not register torch.ops.zentorch.{', '.join(missing)}"
    if not module._C.is_avx512_supported():
        return None, "zentorch reports that this host lacks the AVX-512 features it needs"
    return module, None


def _pin(*tensors: torch.Tensor | None) -> None:
    _PINNED.append(tuple(t for t in tensors if t is not None))


@dataclass
class WoqState:
    weight: torch.Tensor  # int32 [K/8, N] (a transposed view of zentorch's [N, K/8] packing)
    scales: torch.Tensor  # float32 [G, N]
    zeros: torch.Tensor | None  # int8 or bfloat16 [G, N], or None (symmetric)
    perm: torch.Tensor | None  # int64 [K]: input column order (act-order), or None
    out_features: int


@dataclass
class Int8State:
    weight: torch.Tensor  # int8 [N, K]; never read back after zendnnl has seen it
    scales: torch.Tensor  # float32 [N]
    weight_sums: torch.Tensor  # float32 [N] = w_scale * sum_k w_q, for activation zero points
    constants: tuple[torch.Tensor, ...]  # input scale 1 [1], input zero 0 [1], weight zeros 0 [N]
    activation: ActivationQuant
    out_features: int


class _ZentorchBase(LinearKernel):
    """What both zentorch kernels share: the platform/library gate and the [..., K] plumbing."""

    @classmethod
    def supported(cls, platform: Platform) -> str | None:
        if not platform.is_zen:
            return f"zentorch runs on AMD Zen CPUs only; this is {platform.vendor} {platform.microarch}"
        missing = platform.missing(*REQUIRED_FLAGS)
        if missing:
            return (f"zentorch needs AVX-512 ({' '.join(REQUIRED_FLAGS)}: its is_avx512_supported() check); "
                    f"this {platform.microarch} CPU lacks {', '.join(missing)}")
        return load_zentorch()[1]

    @classmethod
    def _check_loaded(cls, weight: QuantizedWeight) -> None:
        reason = load_zentorch()[1]
        if reason is not None:
            raise KernelError(f"{weight.name}: kernel '{cls.name}' cannot prepare it: {reason}")

    @classmethod
    def apply(cls, state, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)  # [M, K]
        y = torch.zeros(0, state.out_features) if x2.shape[0] == 0 else cls._matmul(state, x2)  # [M, N] float32
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*lead, state.out_features).to(x.dtype)

    @classmethod
    @abstractmethod
    def _matmul(cls, state, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] (M > 0) -> float32 [M, N], without bias."""


class ZentorchKernel(_ZentorchBase):
    """W8A8: int8 x int8 GEMM (``zentorch_qlinear``) on activations quantized exactly as the reference does."""

    name = "zentorch"

    @classmethod
    def can_implement(cls, cfg: LinearLayerConfig) -> str | None:
        if cfg.bits != 8:
            return (f"zentorch runs W8A8 layers (int8 weights and activations); this layer has {cfg.bits}-bit "
                    "weights (4-bit weight-only layers: kernel 'zentorch_woq')")
        if cfg.act == ActKind.FLOAT:
            return "zentorch has no weight-only int8 op (W8A16); its int8 GEMM needs int8 activations"
        if cfg.act == ActKind.INT8_GROUP:
            return "zentorch_qlinear takes one activation scale per token, not one per group"
        if not cfg.symmetric or cfg.has_offsets:
            return "zentorch_qlinear takes symmetric int8 weights; this layer has zero points or offsets"
        if not cfg.per_channel:
            return ("zentorch_qlinear takes one weight scale per output channel; "
                    f"this layer has groups of {cfg.group_size}")
        return None

    @classmethod
    def prepare(cls, weight: QuantizedWeight, cfg: LinearLayerConfig) -> Int8State:
        cls._check_loaded(weight)
        q = (weight.codes.to(torch.int16) - 128).to(torch.int8).contiguous()  # [N, K]
        scales = weight.scales[:, 0].float().contiguous()  # [N]
        sums = q.sum(dim=1, dtype=torch.int64).float() * scales  # [N], computed before zendnnl sees q
        consts = (torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.zeros(q.shape[0], dtype=torch.int32))
        _pin(q, scales, *consts)
        return Int8State(q, scales, sums, consts, weight.activation, weight.out_features)

    @classmethod
    def _matmul(cls, state: Int8State, x2: torch.Tensor) -> torch.Tensor:
        q, scale, zero = quantize_activations(x2, state.activation)  # int8 [M, K]; float32 [M or 1, 1]
        one, zp, w_zp = state.constants
        acc = torch.ops.zentorch.zentorch_qlinear(
            q, state.weight, one, zp, state.scales, w_zp, None, None, None, torch.float32)  # [M, N] acc * w_scale
        if bool((zero != 0).any()):  # sum_k (q - z) w = sum_k q w - z sum_k w
            acc = acc - zero * state.weight_sums
        return acc * scale


class ZentorchWoqKernel(_ZentorchBase):
    """W4A16: ``zentorch_woq_linear`` on bfloat16 activations.

    Registered but in no priority list: on the development Zen 4 (4096x4096,
    g128, one thread) it took 1.5 ms per token against 0.9 ms for the torch
    kernel's int4pack, about equal at M=64, and it keeps a second, reordered
    copy of the weight.  Force it with ``QUILL_KERNEL=zentorch_woq``.
    """

    name = "zentorch_woq"

    @classmethod
    def can_implement(cls, cfg: LinearLayerConfig) -> str | None:
        if cfg.bits != 4:
            return f"zentorch_woq runs 4-bit weight-only layers; this layer has {cfg.bits}-bit weights"
        if cfg.act != ActKind.FLOAT:
            return "zentorch has no W4A8 op (4-bit weights with int8 activations)"
        if cfg.in_features % _WOQ_PACK:
            return f"zentorch_woq_repack_weight needs in_features divisible by 8, found {cfg.in_features}"
        return None

    @classmethod
    def prepare(cls, weight: QuantizedWeight, cfg: LinearLayerConfig) -> WoqState:
        cls._check_loaded(weight)
        w, perm = contiguous_groups(weight)
        s = w.scales.float()  # [N, G]
        if w.offsets is not None:  # zendnnl's float zero: w = (q - 8) * s + z
            zero = 8.0 if w.zeros is None else w.zeros.float()
            zeros = ((8.0 - zero) * s + w.offsets.float()).to(torch.bfloat16).T.contiguous()  # [G, N]
            nibbles = w.codes.to(torch.int8)
        elif w.zeros is None:
            zeros, nibbles = None, (w.codes.to(torch.int16) - 8).to(torch.int8)  # signed s4
        else:
            zeros, nibbles = w.zeros.to(torch.int8).T.contiguous(), w.codes.to(torch.int8)  # u4, [G, N]
        packed = torch.ops.zentorch.zentorch_woq_repack_weight(nibbles.contiguous()).transpose(0, 1)  # [K/8, N]
        scales = s.T.contiguous()  # [G, N]
        _pin(packed, scales, zeros)
        return WoqState(packed, scales, zeros, perm, w.out_features)

    @classmethod
    def _matmul(cls, state: WoqState, x2: torch.Tensor) -> torch.Tensor:
        if state.perm is not None:
            x2 = x2[:, state.perm]
        return torch.ops.zentorch.zentorch_woq_linear(
            x2.to(torch.bfloat16).contiguous(), state.weight, state.scales, state.zeros, None).float()
