"""Act-order (``g_idx``) resolved once at load: sort input columns so every scale group is contiguous.

Kernels whose native layout wants contiguous, equal-size groups call
:func:`contiguous_groups` in ``prepare`` and gather the input columns with the
returned permutation in ``apply`` (``x[:, perm]``), which leaves ``x @ W^T``
unchanged.  The sort itself is ``QuantizedWeight.group_order`` (the leaf), which
native packing shares.
"""

from __future__ import annotations

import math

import torch

from quill.canonical import QuantizedWeight


def contiguous_groups(w: QuantizedWeight) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """``(weight, perm)`` with ``weight``'s groups contiguous and equal-sized, and perm int64 [K] or None.

    Without ``g_idx`` the weight is returned unchanged.  With it, columns are
    sorted by group (stable); groups of unequal size (possible in malformed or
    hand-made checkpoints) are split into sub-groups of the greatest common
    size, each repeating its group's scale/zero/offset, so the result is exact
    for any ``g_idx``.
    """
    if w.g_idx is None:
        return w, None
    perm, counts = w.group_order()  # [K], [G]
    present = counts[counts > 0]
    sub = math.gcd(*present.tolist()) if present.numel() else w.in_features
    repeats = counts // sub  # sub-groups per original group (0 for an unused group)

    def expand(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat_interleave(repeats, dim=1).contiguous()  # [N, K / sub]

    out = w.with_(codes=w.codes[:, perm].contiguous(), g_idx=None, group_size=sub,
                  scales=expand(w.scales), zeros=expand(w.zeros), offsets=expand(w.offsets))
    return out, perm
