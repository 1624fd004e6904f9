"""The canonical quantized weight: the one description every format converts into.

Formats convert *into* :class:`QuantizedWeight` (one converter each) and kernels
repack *out of* it (one ``prepare`` each), so formats x kernels stays N + M.
A leaf: it imports torch and quill.errors only, so a kernel that needs the
canonical weight loads no format; a weight is frozen once built (``with_`` copies).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUB_SCALE_DTYPES = (torch.int8, torch.int16)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A power-of-two scale in one byte (OCP MX's E8M0: 2 ** (e - 127); e = 255 is NaN and refused).
E8M0 = torch.float8_e8m0fnu
# OCP MX FP4 (E2M1) values by code: bit 3 is the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@dataclass(frozen=True)
class ActivationQuant:
    """How a layer's *input* is quantized to integers at run time (W8A8, W4A8).

    ``dynamic=True``: one scale per token (row of the input), computed at run
    time from the row itself; with ``per_group`` one per token and weight group
    (the weight's scale groups, as llama.cpp's 8-bit blocks of 32 for Q4_0).
    ``dynamic=False``: one static scale (and zero point, if asymmetric) for the
    whole tensor, read from the checkpoint.

    The exact arithmetic lives in :mod:`quill.kernels.activation`; it follows
    compressed-tensors (scale = amax / 127.5 symmetric, round half to even,
    clamp to [-128, 127]).
    """

    bits: int = 8
    dynamic: bool = True
    symmetric: bool = True
    scale: float | None = None  # static only
    zero_point: int | None = None  # static asymmetric only
    per_group: bool = False  # dynamic symmetric: one scale per token and weight group (llama.cpp's Q8_0 blocks;
    # two-level weights: per super-group, its Q8_K; QuantizedWeight.activation_groups)

    def __post_init__(self):
        if self.bits != 8:
            raise UnsupportedFormatError(
                f"activation quantization to {self.bits} bits is not supported; supported: 8"
            )
        if not self.dynamic and self.scale is None:
            raise ConfigError("static activation quantization needs an input scale, found none")
        if self.dynamic and (self.scale is not None or self.zero_point is not None):
            raise ConfigError("dynamic activation quantization cannot carry a static scale or zero point")
        if self.per_group and not (self.dynamic and self.symmetric):
            raise ConfigError("int8 activations with one scale per group must be dynamic and symmetric")
        if self.symmetric and self.zero_point not in (None, 0):
            raise ConfigError(f"symmetric activation quantization has zero point {self.zero_point}, expected 0 or none")


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A linear layer's quantized weight in logical orientation ``[out_features, in_features]``.

    Dequantization, the one formula every format and kernel agrees on::

        g          = g_idx[i]            if g_idx is not None
                     i // group_size     otherwise
        z[o, g]    = zeros[o, g]         if zeros is not None   (asymmetric)
                     2 ** (bits - 1)     otherwise              (symmetric)
        s[o, g]    = super_scales[o, g // k] * scales[o, g]    if super_scales is not None (two-level)
                     scales[o, g]                              otherwise
        m[o, g]    = super_offsets[o, g // k] * offsets[o, g]  if super_offsets is not None (two-level)
                     offsets[o, g]                             otherwise
        w[o, i]    = (codes[o, i] - z[o, g]) * s[o, g]  (+ m[o, g] if offsets is not None)

    with ``k = G / S`` groups per super-group.  Codes that index a non-uniform value table
    (``codebook``, FP4 E2M1 for MXFP4) skip the zero point::

        w[o, i]    = codebook[codes[o, i]] * scales[o, g]

    Computed in float32 (scales upcast
    from their stored dtype), which makes it exact for every format quill reads:
    ``codes - z`` is a small integer, a 16-bit scale times a small integer
    sub-scale is representable in float32, and so is its product with the code.

    Fields:
        codes:   uint8 [out, in], unsigned integer codes in [0, 2**bits).
        bits:    2, 3, 4, 5, 6 or 8.
        group_size: input columns per scale group; ``in_features`` for per-channel.
        scales:  float [out, G] in the checkpoint's dtype (may be negative:
                 auto-round's symmetric RTN produces negative scales); with
                 ``super_scales``, small integers int8/int16 [out, G] (sub-scales).
        zeros:   int16 [out, G] integer zero points in [0, 2**bits], or None (symmetric).
        offsets: float [out, G] added after scaling (GGUF Q4_1's ``min``), or None;
                 with ``super_offsets``, small integers int8/int16 [out, G].
        super_scales:  float [out, S] scale of every super-group of ``G / S`` groups
                 (the two-level scales of block formats with 6-bit sub-scales), or None.
        super_offsets: float [out, S] the same for offsets, or None (needs ``offsets``).
        g_idx:   int32 [in], act-order group of each input column, or None.
        dtype:   the model's original float dtype (what the weight was quantized from).
        bias:    float [out] or None.
        activation: the input quantization the checkpoint prescribes (W8A8), or None.
        codebook: float32 [2**bits], the value of every code, or None (uniform codes).  With it:
                 symmetric, no offsets, single-level scales, no act-order; scales may be
                 ``E8M0`` (MXFP4: FP4 E2M1 codes, a power-of-two scale per 32 weights,
                 4.25 bits per weight as stored).  :meth:`uniform` is the same values with
                 integer codes, for kernels that read only uniform codes.
    """

    codes: torch.Tensor
    bits: int
    group_size: int
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    dtype: torch.dtype = torch.bfloat16
    bias: torch.Tensor | None = None
    activation: ActivationQuant | None = None
    super_scales: torch.Tensor | None = None
    super_offsets: torch.Tensor | None = None
    codebook: torch.Tensor | None = None
    name: str = field(default="<unnamed>", compare=False)

    # ---- shape facts -------------------------------------------------
    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def has_act_order(self) -> bool:
        return self.g_idx is not None

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.in_features

    @property
    def two_level(self) -> bool:
        """Scales (and maybe offsets) are a float per super-group times a small integer per group."""
        return self.super_scales is not None or self.super_offsets is not None

    @property
    def groups_per_super(self) -> int:
        """Groups per super-group (1 for single-level scales)."""
        sup = self.super_scales if self.super_scales is not None else self.super_offsets
        return 1 if sup is None else self.num_groups // sup.shape[1]

    def group_scales(self) -> torch.Tensor:
        """float32 [out, G]: every group's scale (``s`` of the formula), exact."""
        return _expand_level(self.scales, self.super_scales)

    def group_offsets(self) -> torch.Tensor | None:
        """float32 [out, G] (``m`` of the formula), exact, or None."""
        return None if self.offsets is None else _expand_level(self.offsets, self.super_offsets)

    def single_level(self) -> "QuantizedWeight":
        """The same weight with one float32 scale (and offset) per group: exact, for kernels that
        read single-level scales.  Returns ``self`` when it already is."""
        if not self.two_level:
            return self
        return self.with_(scales=self.group_scales(), offsets=self.group_offsets(),
                          super_scales=None, super_offsets=None)

    def widened(self, bits: int) -> "QuantizedWeight":
        """The same values with ``bits``-bit codes (>= ``self.bits``): codes unchanged, a symmetric
        weight's implicit zero spelt out.  For kernels that run a wider code than stored."""
        if bits < self.bits:
            raise ConfigError(f"{self.name}: cannot widen {self.bits}-bit codes to {bits} bits")
        if self.codebook is not None:
            raise ConfigError(f"{self.name}: codebook codes cannot be widened; uniform() re-expresses them")
        if bits == self.bits:
            return self
        zeros = self.zeros
        if zeros is None:
            zeros = torch.full(tuple(self.scales.shape), 1 << (self.bits - 1), dtype=torch.int16)
        return self.with_(bits=bits, zeros=zeros)

    def uniform(self) -> "QuantizedWeight":
        """The same values with uniform integer codes, for kernels that read no codebook; ``self`` when
        the codes already are.  Every codebook value must be an integer multiple ``q * u`` of a power of
        two ``u`` (FP4 E2M1: u = 0.5, q in [-12, 12]); codes become ``q + 2**(bits'-1)`` at the fewest
        bits that hold them (:meth:`uniform_bits`: 5 for FP4) and scales ``s * u`` in float32, exact
        (a power of two times a power of two, or a float times 2**-k)."""
        if self.codebook is None:
            return self
        u, q, bits = self._uniform_form()
        codes = (q + (1 << (bits - 1))).to(torch.uint8)[self.codes.long()]
        return self.with_(codes=codes, bits=bits, scales=self.scales.to(torch.float32) * u, codebook=None)

    def uniform_bits(self) -> int:
        """The code width of :meth:`uniform` (``bits`` when the codes already are uniform)."""
        return self.bits if self.codebook is None else self._uniform_form()[2]

    def _uniform_form(self) -> tuple[float, torch.Tensor, int]:
        """(u, q int64 [2**bits], bits'): codebook == q * u, q fits bits'-bit two's complement."""
        cb = self.codebook.to(torch.float64)
        u = 1.0
        while not bool((cb / u == torch.round(cb / u)).all()):
            u /= 2
            if u < 2.0 ** -24:
                raise UnsupportedFormatError(f"{self.name}: codebook {self.codebook.tolist()} is not a set of "
                                             "multiples of a power of two; no uniform form")
        q = torch.round(cb / u).to(torch.int64)
        bits = next((b for b in SUPPORTED_BITS if -(1 << (b - 1)) <= int(q.min()) and int(q.max()) < 1 << (b - 1)),
                    None)
        if bits is None:
            raise UnsupportedFormatError(f"{self.name}: codebook {self.codebook.tolist()} spans more than 8 bits")
        return u, q, bits

    def take_rows(self, ids: torch.Tensor) -> "QuantizedWeight":
        """Output rows ``ids`` of every per-row tensor (codes, scales, zeros, offsets, super-, bias)."""
        def pick(t):
            return None if t is None else t.index_select(0, ids)
        return self.with_(codes=pick(self.codes), scales=pick(self.scales), zeros=pick(self.zeros),
                          offsets=pick(self.offsets), bias=pick(self.bias),
                          super_scales=pick(self.super_scales), super_offsets=pick(self.super_offsets))

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: ``take_rows(ids).dequantize()``, the same bits, in fewer ops when the
        groups are contiguous (no act-order): broadcast per group instead of gathered per column.
        An embedding lookup runs it every step."""
        if (self.g_idx is not None or self.codebook is not None
                or self.in_features != self.num_groups * self.group_size):
            return self.take_rows(ids).dequantize()

        def pick(t):
            return None if t is None else t.index_select(0, ids).to(torch.float32)[..., None]  # [n, G, 1]
        n = ids.numel()
        w = self.codes.index_select(0, ids).to(torch.float32).view(n, self.num_groups, self.group_size)
        if self.zeros is None:
            w = w - float(1 << (self.bits - 1))
        else:
            w = w - pick(self.zeros)
        sup = None if self.super_scales is None else self.super_scales.index_select(0, ids)
        w = w * _expand_level(self.scales.index_select(0, ids), sup)[..., None]
        if self.offsets is not None:
            sup = None if self.super_offsets is None else self.super_offsets.index_select(0, ids)
            w = w + _expand_level(self.offsets.index_select(0, ids), sup)[..., None]
        return w.view(n, self.in_features)

    @staticmethod
    def concat_rows(ws: "list[QuantizedWeight]", name: str) -> "QuantizedWeight":
        """The rows of weights of one ``layout()`` stacked in order, as one weight (every per-row tensor)."""
        def cat(field):
            parts = [getattr(w, field) for w in ws]
            return None if parts[0] is None else torch.cat(parts)
        return ws[0].with_(codes=cat("codes"), scales=cat("scales"), zeros=cat("zeros"), offsets=cat("offsets"),
                           bias=cat("bias"), super_scales=cat("super_scales"), super_offsets=cat("super_offsets"),
                           name=name)

    def layout(self) -> tuple:
        """What two weights must share for their rows to be concatenated into one weight."""
        def kind(t):
            return None if t is None else t.dtype
        return (self.bits, self.group_size, self.in_features, self.num_groups, self.groups_per_super,
                self.dtype, self.activation, kind(self.scales), kind(self.zeros), kind(self.offsets),
                kind(self.super_scales), kind(self.super_offsets), kind(self.bias), kind(self.codes),
                None if self.codebook is None else tuple(self.codebook.tolist()))

    def group_index(self) -> torch.Tensor:
        """int64 [in]: the scale group of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features) // self.group_size

    def activation_groups(self) -> torch.Tensor:
        """int64 [in]: the group of every input column for int8 activations per token and group (``per_group``):
        the weight's groups, or with two-level scales its super-groups, as llama.cpp quantizes activations for
        its K-quants (Q8_K: one scale per 256) and sums the integer sub-scales before one float multiply."""
        if self.super_scales is None or self.g_idx is not None:
            return self.group_index()
        return self.group_index() // self.groups_per_super

    def group_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(perm int64 [K]: the input columns sorted by act-order group, stable; counts int64 [G]: columns
        per group), for a weight with ``g_idx``.

        The one place act-order columns are sorted: the torch, zentorch and native kernels all start
        here (kept on the leaf, so native packing and the kernels share it without importing each other).
        """
        g = self.g_idx.long()
        return torch.argsort(g, stable=True), torch.bincount(g, minlength=self.num_groups)

    def storage_bytes(self) -> int:
        """Bytes this weight occupies when packed: codes at ``bits`` each, plus scales/zeros/offsets."""
        n = self.out_features * self.in_features * self.bits // 8
        for sub, sup in ((self.scales, self.super_scales), (self.offsets, self.super_offsets)):
            if sub is None:
                continue
            if sup is None:
                n += sub.numel() * sub.element_size()
            else:  # integer sub-scales at the bits they need (6 for GGUF K-quants), floats per super-group
                n += (sub.numel() * _int_bits(sub) + 7) // 8 + sup.numel() * sup.element_size()
        if self.zeros is not None and bool(self.zeros.any()):
            n += (self.zeros.numel() * self.bits + 7) // 8
        return n

    # ---- the formula -------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], computed exactly as the class docstring says."""
        if self.g_idx is None and self.in_features % self.group_size == 0:
            # Contiguous groups: the same element-wise formula on an [out, G, group] view, each group
            # tensor broadcast instead of gathered to [out, in] (the same bits, several times faster).
            codes = self.codes.reshape(self.out_features, -1, self.group_size)
            return self._formula(codes, lambda t: t.to(torch.float32).unsqueeze(-1)).reshape(
                self.out_features, self.in_features)
        g = self.group_index()
        return self._formula(self.codes, lambda t: t.to(torch.float32)[:, g])

    def _formula(self, codes: torch.Tensor, per_group) -> torch.Tensor:
        """The formula on ``codes``; ``per_group`` lays an [out, G] tensor beside them."""
        if self.codebook is not None:
            return self.codebook.to(torch.float32)[codes.long()] * per_group(self.scales)
        w = codes.to(torch.float32)
        if self.zeros is None:
            w = w - float(1 << (self.bits - 1))
        else:
            w = w - per_group(self.zeros)
        w = w * per_group(self.group_scales())
        if self.offsets is not None:
            w = w + per_group(self.group_offsets())
        return w

    def with_(self, **changes) -> "QuantizedWeight":
        """A copy with some fields replaced (dataclasses.replace)."""
        return replace(self, **changes)

    # ---- saving (the prepacked cache) ----------------------------------
    TENSOR_FIELDS = ("codes", "scales", "zeros", "offsets", "g_idx", "bias", "super_scales", "super_offsets",
                     "codebook")

    def saved(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """This weight as JSON-able facts and its tensors (:meth:`from_saved` rebuilds it)."""
        facts = {"bits": self.bits, "group_size": self.group_size, "dtype": str(self.dtype).removeprefix("torch."),
                 "name": self.name,
                 "activation": None if self.activation is None else asdict(self.activation)}
        return facts, {f: t for f in self.TENSOR_FIELDS if (t := getattr(self, f)) is not None}

    @classmethod
    def from_saved(cls, facts: dict, tensors: dict[str, torch.Tensor]) -> "QuantizedWeight":
        dtype = getattr(torch, facts["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{facts['name']}: saved dtype '{facts['dtype']}' is not a torch dtype")
        act = None if facts["activation"] is None else ActivationQuant(**facts["activation"])
        return cls(bits=facts["bits"], group_size=facts["group_size"], dtype=dtype, name=facts["name"],
                   activation=act, **{f: tensors.get(f) for f in cls.TENSOR_FIELDS}).validate()

    # ---- consistency -------------------------------------------------
    def validate(self) -> "QuantizedWeight":
        """Check every field against the others; raise a typed error naming the layer."""
        n = self.name
        if self.bits not in SUPPORTED_BITS:
            raise UnsupportedFormatError(f"{n}: bits={self.bits} is not supported; supported: {list(SUPPORTED_BITS)}")
        _expect(self.codes.dtype == torch.uint8 and self.codes.dim() == 2, n, "codes",
                f"uint8 [out, in], found {self.codes.dtype} {list(self.codes.shape)}")
        out, inp = self.codes.shape
        if self.group_size <= 0 or inp % self.group_size:
            raise ConfigError(
                f"{n}: group_size {self.group_size} does not divide in_features {inp}; "
                "supported: a positive divisor of in_features (or per-channel)")
        scale_kinds = SUB_SCALE_DTYPES if self.super_scales is not None else FLOAT_DTYPES
        if self.codebook is not None:
            scale_kinds = FLOAT_DTYPES + (E8M0,)
            self._validate_codebook()
        _expect(self.scales.dtype in scale_kinds and self.scales.dim() == 2 and self.scales.shape[0] == out,
                n, "scales", f"{_kind(scale_kinds)} [out={out}, G], found {self.scales.dtype} "
                f"{list(self.scales.shape)}")
        groups = self.scales.shape[1]
        self._validate_levels(out, groups)
        if self.g_idx is None and groups != inp // self.group_size:
            raise CheckpointError(
                f"{n}: scales have {groups} groups but in_features {inp} / group_size {self.group_size} "
                f"= {inp // self.group_size}")
        if self.zeros is not None:
            _expect(self.zeros.dtype == torch.int16 and tuple(self.zeros.shape) == (out, groups), n, "zeros",
                    f"int16 [{out}, {groups}], found {self.zeros.dtype} {list(self.zeros.shape)}")
        if self.offsets is not None:
            kinds = SUB_SCALE_DTYPES if self.super_offsets is not None else FLOAT_DTYPES
            _expect(self.offsets.dtype in kinds and tuple(self.offsets.shape) == (out, groups), n,
                    "offsets", f"{_kind(kinds)} [{out}, {groups}], found {self.offsets.dtype} "
                    f"{list(self.offsets.shape)}")
        if self.g_idx is not None:
            _expect(self.g_idx.dtype == torch.int32 and tuple(self.g_idx.shape) == (inp,), n, "g_idx",
                    f"int32 [{inp}], found {self.g_idx.dtype} {list(self.g_idx.shape)}")
            if inp and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= groups):
                raise CheckpointError(
                    f"{n}: g_idx values span [{int(self.g_idx.min())}, {int(self.g_idx.max())}], "
                    f"expected group indices in [0, {groups})")
        if self.bias is not None:
            _expect(self.bias.dtype in FLOAT_DTYPES and tuple(self.bias.shape) == (out,), n, "bias",
                    f"float [{out}], found {self.bias.dtype} {list(self.bias.shape)}")
        if self.codes.numel() and int(self.codes.max()) >= (1 << self.bits):
            raise CheckpointError(
                f"{n}: codes reach {int(self.codes.max())}, above the {self.bits}-bit maximum {(1 << self.bits) - 1}")
        return self

    def _validate_codebook(self) -> None:
        n, cb = self.name, self.codebook
        _expect(cb.dtype == torch.float32 and tuple(cb.shape) == (1 << self.bits,), n, "codebook",
                f"float32 [{1 << self.bits}], found {cb.dtype} {list(cb.shape)}")
        extra = [f for f in ("zeros", "offsets", "super_scales", "super_offsets", "g_idx")
                 if getattr(self, f) is not None]
        if extra:
            raise ConfigError(f"{n}: codebook codes with {', '.join(extra)} are not supported; "
                              "supported: symmetric codebook codes with one scale per group")
        if self.scales.dtype == E8M0 and bool((self.scales.view(torch.uint8) == 255).any()):
            raise CheckpointError(f"{n}: tensor 'scales' has E8M0 exponent 255 (NaN in the MX spec); "
                                  "supported: exponents 0-254")

    def _validate_levels(self, out: int, groups: int) -> None:
        n = self.name
        if self.super_offsets is not None and self.offsets is None:
            raise CheckpointError(f"{n}: tensor 'super_offsets' is set but there are no offsets")
        supers = [t for t in (self.super_scales, self.super_offsets) if t is not None]
        for label, t in zip(("super_scales", "super_offsets"), (self.super_scales, self.super_offsets)):
            if t is None:
                continue
            _expect(t.dtype in FLOAT_DTYPES and t.dim() == 2 and t.shape[0] == out and t.shape[1] > 0
                    and groups % t.shape[1] == 0, n, label,
                    f"float [{out}, S] with S dividing the {groups} groups, found {t.dtype} {list(t.shape)}")
        if len(supers) == 2 and supers[0].shape != supers[1].shape:
            raise CheckpointError(f"{n}: super_scales {list(supers[0].shape)} and super_offsets "
                                  f"{list(supers[1].shape)} differ in shape")
        if supers and self.g_idx is not None:
            raise ConfigError(f"{n}: two-level scales with act-order (g_idx) are not supported")


def _expand_level(sub: torch.Tensor, sup: torch.Tensor | None) -> torch.Tensor:
    """float32 [out, G]: ``sub`` itself, or ``sup[:, g // k] * sub[:, g]`` (one rounding, exact here)."""
    if sup is None:
        return sub.to(torch.float32)
    k = sub.shape[1] // sup.shape[1]
    return sup.to(torch.float32).repeat_interleave(k, dim=1) * sub.to(torch.float32)


def _int_bits(t: torch.Tensor) -> int:
    """Bits a two's-complement / unsigned integer tensor needs (at least 1)."""
    if not t.numel():
        return 1
    lo, hi = int(t.min()), int(t.max())
    if lo >= 0:
        return max(1, hi.bit_length())
    return max(hi.bit_length(), (-lo - 1).bit_length()) + 1


def _kind(dtypes: tuple) -> str:
    return "int" if dtypes == SUB_SCALE_DTYPES else "float"


def _expect(ok: bool, layer: str, tensor: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{layer}: tensor '{tensor}' should be {what}")
