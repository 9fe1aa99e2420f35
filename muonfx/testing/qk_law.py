"""The QK-clip law: check :func:`muonfx.qk_clip` on your own attention layout.

:func:`check_qk_clip` runs ``inner`` (the chain without the clip), then
:func:`muonfx.qk_clip` on its output (what ``chain(inner, qk_clip(...))`` computes), on
the same parameters and gradients, and checks three things of the clipped result:

1. **logits**: the attention logits computed with the clipped weights are, head by
   head, ``gamma_h`` times those computed with the unclipped weights ``W + u`` (for
   grouped-query attention: ``gamma_h ** alpha * gamma_g ** (1 - alpha)``, ``g`` the
   head's group); exact up to rounding, since logits are bilinear in ``W_q`` and ``W_k``;
2. **untouched**: a parameter outside the layout, and every row of a head whose maximum
   was at or under ``tau`` (value rows included), gets bit for bit the update of ``inner``;
3. **rows**: on the clipped rows the update is ``gamma * (W + u) - W``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from tensordict import TensorDictBase

from ..core import GradientTransformation, apply_updates
from ..transforms.qk import QK_STAT, QKLayout, qk_clip, qk_factors

__all__ = ["QKClipLawError", "check_qk_clip"]


class QKClipLawError(AssertionError):
    """:func:`check_qk_clip` found a broken law; the message names it, the layer, the head
    or parameter, and the values."""


def _tol(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 2e-2)


def check_qk_clip(inner: GradientTransformation, layout: Mapping[str, QKLayout], params: TensorDictBase,
                  grads: TensorDictBase, logits: Callable[[TensorDictBase], Mapping[str, torch.Tensor]],
                  qk_logit_max: Mapping[str, torch.Tensor], tau: float = 100.0, alpha: float = 0.5,
                  rtol: float | None = None) -> dict[str, Any]:
    """Check QK-clip's three laws (module doc) on one step; raise :class:`QKClipLawError`.

    ``logits(params) -> {layer: tensor [heads, ...]}`` computes each layer's pre-softmax
    logits from parameters (your attention, RoPE and all, on a fixed input);
    ``qk_logit_max`` are the statistics the step gets. ``rtol`` defaults to 1e-10 for
    float64 parameters, 1e-4 for float32. Returns ``{"clipped heads": {layer: [h, ...]},
    "max error": float}``.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> from muonfx.testing import check_qk_clip
        >>> H, d, D = 2, 4, 8
        >>> g = torch.Generator().manual_seed(0)
        >>> params = TensorDict({"qkv": torch.randn(3 * H * d, D, generator=g, dtype=torch.float64)}, [])
        >>> grads = TensorDict({"qkv": torch.randn(3 * H * d, D, generator=g, dtype=torch.float64)}, [])
        >>> x = torch.randn(5, D, generator=g, dtype=torch.float64)
        >>> def logits(p):
        ...     q, k, _ = (x @ p["qkv"].T).view(5, 3, H, d).permute(1, 2, 0, 3)
        ...     return {"attn": q @ k.mT / d ** 0.5}
        >>> layout = {"attn": mfx.QKLayout.fused("qkv", heads=H, head_dim=d)}
        >>> out = check_qk_clip(mfx.scale(-0.1), layout, params, grads, logits,
        ...                     {"attn": torch.tensor([50.0, 300.0])}, tau=100.0)
        >>> out["clipped heads"]
        {'attn': [1]}
    """
    clip = qk_clip(tau, alpha, layout)  # what chain(inner, clip) computes, the two halves kept apart
    u0, _ = inner.update(grads, inner.init(params), params)
    u1, _ = clip.update(u0, clip.init(params), params, **{QK_STAT: dict(qk_logit_max)})
    unclipped, new = apply_updates(params, u0), apply_updates(params, u1)
    keys_in_layout = {k for lay in layout.values() for k in lay.keys()}
    worst = 0.0
    # 2. untouched: parameters outside the layout
    for key in u0.keys(include_nested=True, leaves_only=True):
        name = key if isinstance(key, str) else ".".join(key)
        if name not in keys_in_layout and not torch.equal(u0[key], u1[key]):
            raise QKClipLawError(f"untouched: parameter {name!r} is in no layer's layout, but its update differs "
                                 "from the chain's without the clip")
    l0, l1 = logits(unclipped), logits(new)
    heads_out: dict[str, list[int]] = {}
    for layer, lay in layout.items():
        s = torch.as_tensor(qk_logit_max[layer])
        qf, kf = qk_factors(s, tau, alpha, lay.kv_heads)
        per_head = qf * kf.repeat_interleave(lay.heads // lay.kv_heads)
        heads_out[layer] = [h for h in range(lay.heads) if per_head[h] < 1]
        a, b = l0[layer], l1[layer]
        tol = rtol if rtol is not None else _tol(a.dtype)
        for h in range(lay.heads):
            want = per_head[h].to(a.dtype) * a[h]
            err = ((b[h] - want).abs().max() / a[h].abs().max().clamp_min(torch.finfo(a.dtype).tiny)).item()
            worst = max(worst, err)
            if err > tol:
                raise QKClipLawError(f"logits: layer {layer!r} head {h}: the logits with the clipped weights are not "
                                     f"{per_head[h].item():.6g} times those with W + u (relative error {err:.3g} > "
                                     f"{tol:g})")
        # 2. untouched rows and 3. clipped rows, parameter by parameter
        for name in lay.keys():
            key = tuple(name.split("."))
            if key not in u0.keys(include_nested=True, leaves_only=True):
                continue
            w, a_u, b_u = params[key], u0[key], u1[key]
            is_bias = name in (lay.qkv_bias, lay.q_bias, lay.k_bias)
            rows_dim = 0 if is_bias or not lay.transposed else 1
            f = lay.row_factors(name, qf, kf, a_u.shape[rows_dim])
            for r in range(f.numel()):
                ur0, ur1, wr = (t.select(rows_dim, r) for t in (a_u, b_u, w))
                if f[r] >= 1:
                    if not torch.equal(ur0, ur1):
                        raise QKClipLawError(f"untouched: parameter {name!r} row {r} (not clipped) has an update "
                                             "that differs from the chain's without the clip")
                    continue
                want = f[r].to(wr.dtype) * (wr + ur0) - wr
                scale = (wr + ur0).abs().max().clamp_min(torch.finfo(wr.dtype).tiny)
                err = ((ur1 - want).abs().max() / scale).item()
                worst = max(worst, err)
                if err > (rtol if rtol is not None else _tol(wr.dtype)):
                    raise QKClipLawError(f"rows: parameter {name!r} row {r}: the update is not gamma * (W + u) - W "
                                         f"(gamma {f[r].item():.6g}, relative error {err:.3g})")
    return {"clipped heads": heads_out, "max error": worst}
