"""What the attention kernels read: the codes of one layer, laid out codec-independently.

Every supported codec reduces to the same two operations over b-bit packed codes
(:mod:`qjl.packing` layout, LSB first):

* a **key part** scores ``s[r, t] = norm[t] * sum_c qp[r, c] * cent[code[t, c]]``, where
  ``qp`` is the query already mapped into the code's basis (and scaled):
  TurboQuant MSE keys: ``qp = Pi q``, ``cent`` = the Lloyd-Max codebook, ``norm = ||k||``;
  QJL keys: ``qp = c * S q`` (c the estimator's constant), 1-bit codes, ``cent = (-1, +1)``,
  ``norm = ||k||``; QJL outliers add a second part (``S_o q[idx]``, outlier signs and norm).
* a **value part** mixes ``v[t, c] = zero[t, g(c)] + scale[t, g(c)] * cent[code[t, c]]``
  (``g(c) = c // group_size``): token-wise values have ``cent = 0..2^b-1`` and per-group
  scale/zero; TurboQuant MSE values have one group with ``scale = ||v||``, no zero, and
  their output is rotated back with ``Pi^T`` after mixing (linear, so once per query).

A kernel returns the *partial* softmax of the code part, ``(m, l, o)``: the row max of
the logits, ``l = sum exp(s - m)`` and ``o = sum exp(s - m) v`` (in the value basis);
:func:`merge_partials` combines partials (split-K blocks, or codes with the exact
sinks and window) exactly.  :func:`reference_partial` is the plain PyTorch reference
every kernel is tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qjl.codecs.outliers import OutlierQJL
from qjl.core.packing import unpack_bits
from qjl.codecs.sketch import QJLSketch
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.codecs.tokenwise import TokenwiseQuantizer

__all__ = ["KeyPart", "ValuePart", "supports", "key_parts", "value_part", "reference_partial", "merge_partials",
           "partial_exact", "merge_apart", "check_exact"]


@dataclass
class KeyPart:
    """codes [BH, N, nbytes] uint8; q [BH, R, n] f32; cent [2^bits] f32; norm [BH, N] (stored dtype)."""

    codes: torch.Tensor
    bits: int
    n: int
    cent: torch.Tensor
    norm: torch.Tensor
    q: torch.Tensor


@dataclass
class ValuePart:
    """codes [BH, N, nbytes] uint8; cent [2^bits] f32; scale/zero [BH, N, G] in their stored dtype (zero may be None).

    ``post`` maps the mixed [..., n] output back to [..., dim] (TurboQuant's inverse rotation) or is None.
    """

    codes: torch.Tensor
    bits: int
    n: int
    cent: torch.Tensor
    group_size: int
    scale: torch.Tensor
    zero: torch.Tensor | None
    post: object = None


def supports(key_codec, value_codec) -> bool:
    """Whether the kernels cover this pair of codecs (others use the reference path).

    Keys: TurboQuant MSE, QJL, QJL with outliers; values: TurboQuant MSE, token-wise; code
    lengths (rotated dim, sketch dims) and value groups must be multiples of 8 (whole bytes
    of 8 codes), true for every head_dim that is a multiple of 8.
    """
    if isinstance(key_codec, TurboQuantMSE):
        keys_ok = key_codec.rotation.out_dim % 8 == 0
    else:
        keys_ok = isinstance(key_codec, (QJLSketch, OutlierQJL))  # sketch sizes are multiples of 8
    if isinstance(value_codec, TurboQuantMSE):
        return keys_ok and value_codec.rotation.out_dim % 8 == 0
    if isinstance(value_codec, TokenwiseQuantizer):
        return keys_ok and value_codec.dim % 8 == 0 and value_codec.group_size % 8 == 0
    return False


def _flat(t: torch.Tensor, keep: int) -> torch.Tensor:
    """[B, H, *rest] -> [B*H, *rest] contiguous (rest has ``keep`` axes)."""
    return t.reshape(-1, *t.shape[t.ndim - keep:]).contiguous()


def _sign_part(sketch: QJLSketch, q: torch.Tensor, signs: torch.Tensor, norm: torch.Tensor) -> KeyPart:
    qp = sketch.project(q) * sketch.scale
    cent = torch.tensor([-1.0, 1.0], device=q.device)
    return KeyPart(_flat(signs, 2), 1, sketch.sketch_dim, cent, _flat(norm, 1), _flat(qp, 2))


def key_parts(codec, codes, q: torch.Tensor) -> list[KeyPart]:
    """q: [B, H, R, D] float32 (already multiplied by the softmax scaling) -> the key parts."""
    f = codes.fields
    if isinstance(codec, TurboQuantMSE):
        cent = codec._centroids.to(q.device)
        return [KeyPart(_flat(f["codes"], 2), codec.bits, codec.rotation.out_dim, cent,
                        _flat(f["norm"], 1), _flat(codec.rotation.apply(q), 2))]
    if isinstance(codec, QJLSketch):
        return [_sign_part(codec, q, f["signs"], f["norm"])]
    if isinstance(codec, OutlierQJL):
        if codec.outlier is None:
            return [_sign_part(codec.inlier, q, f["signs"], f["norm"])]
        idx = codes.shared["outlier_idx"].long()
        q_in, q_out, _ = codec._split(q, idx)
        return [_sign_part(codec.inlier, q_in, f["signs"], f["norm"]),
                _sign_part(codec.outlier, q_out, f["outlier_signs"], f["outlier_norm"])]
    raise TypeError(f"no kernel for key codec {type(codec).__name__}")


def value_part(codec, codes) -> ValuePart:
    f = codes.fields
    dev = f["codes"].device
    if isinstance(codec, TurboQuantMSE):
        n = codec.rotation.out_dim
        return ValuePart(_flat(f["codes"], 2), codec.bits, n, codec._centroids.to(dev), n,
                         _flat(f["norm"].unsqueeze(-1), 2), None, codec.rotation.inverse)
    if isinstance(codec, TokenwiseQuantizer):
        cent = torch.arange(1 << codec.bits, dtype=torch.float32, device=dev)
        return ValuePart(_flat(f["codes"], 2), codec.bits, codec.dim, cent, codec.group_size,
                         _flat(f["scale"], 2), _flat(f["zero"], 2), None)
    raise TypeError(f"no kernel for value codec {type(codec).__name__}")


def reference_partial(parts: list[KeyPart], vp: ValuePart, bias: torch.Tensor | None = None):
    """The torch reference of every decode kernel.

    bias: [BH, N] additive (0 / -inf) or None.  Returns m, l: [BH, R]; o: [BH, R, n_v] float32.
    """
    s = None
    for p in parts:
        k = p.cent[unpack_bits(p.codes, p.bits, p.n)] * p.norm.float().unsqueeze(-1)  # [BH, N, n]
        part = torch.matmul(p.q, k.transpose(-1, -2))
        s = part if s is None else s + part
    if bias is not None:
        s = s + bias.unsqueeze(-2)
    m = s.amax(dim=-1)
    p_ = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)).unsqueeze(-1))
    l = p_.sum(dim=-1)  # noqa: E741
    group = torch.arange(vp.n, device=s.device) // vp.group_size
    v = vp.cent[unpack_bits(vp.codes, vp.bits, vp.n)] * vp.scale.float()[..., group]
    if vp.zero is not None:
        v = v + vp.zero.float()[..., group]
    return m, l, torch.matmul(p_, v)


def partial_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None):
    """The same partial over exact keys: q [.., R, D], k/v [.., N, D], bias [.., R|1, N] or None."""
    s = torch.matmul(q, k.float().transpose(-1, -2))
    if bias is not None:
        s = s + bias
    m = s.amax(dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)).unsqueeze(-1))
    return m, p.sum(dim=-1), torch.matmul(p, v.float())


def _rescaled(partials):
    """Partials of disjoint key sets brought to their common max: -> (m, l, [o_i * w_i])."""
    m = functools.reduce(torch.maximum, [p[0] for p in partials])
    safe_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l_tot, outs = 0, []
    for pm, pl, po in partials:
        w = torch.exp(pm - safe_m)  # a part whose logits were all -inf (m = -inf, l = 0) gets weight 0
        l_tot = l_tot + w * pl
        outs.append(w.unsqueeze(-1) * po)
    return m, l_tot, outs


def merge_partials(partials):
    """Combine partial softmaxes [(m, l, o), ...] of disjoint key sets -> (m, l, o).

    All tensors share shapes (m, l: [...], o: [..., n]); a part whose logits were all -inf
    (m = -inf, l = 0) contributes nothing (its weight exp(-inf - m) is 0).
    """
    m, l_tot, outs = _rescaled(partials)
    return m, l_tot, sum(outs[1:], outs[0])


def merge_apart(code, exact):
    """Merge an exact partial into a code partial, their outputs kept apart (the code part's may be in a
    rotated space): (m, l, o), (m_x, l_x, o_x) -> (m', l', o * w, o_x * w_x) at the common max m', so that
    the attention output is ``(post(o * w) + o_x * w_x) / l'``."""
    m, l_tot, (o, ox) = _rescaled([code, exact])
    return m, l_tot, o, ox


def check_exact(exact, bh: int, r_rows: int) -> None:
    """``exact`` = (qx [BH, R, D], xk [BH, n, D], xv [BH, n, D], xbias [BH, R, n] or None), else ValueError."""
    if not isinstance(exact, (tuple, list)) or len(exact) != 4:
        raise ValueError("exact must be a tuple (qx, xk, xv, xbias)")
    qx, xk, xv, xbias = exact
    if any(not isinstance(t, torch.Tensor) for t in (qx, xk, xv)) or xk.ndim != 3:
        raise ValueError("exact: qx, xk and xv must be 3-d tensors")
    ne, dx = xk.shape[-2], xk.shape[-1]
    if qx.shape != (bh, r_rows, dx) or xk.shape != (bh, ne, dx) or xv.shape != (bh, ne, dx):
        raise ValueError(f"exact: qx must be [{bh}, {r_rows}, D] and xk/xv [{bh}, n, D], got "
                         f"{tuple(qx.shape)}, {tuple(xk.shape)}, {tuple(xv.shape)}")
    if xbias is not None and tuple(xbias.shape) != (bh, r_rows, ne):
        raise ValueError(f"exact: xbias must be [{bh}, {r_rows}, {ne}], got {tuple(xbias.shape)}")
