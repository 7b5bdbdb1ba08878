"""A scale on the coded keys' scores, fitted per sequence, layer and KV head from the prompt (``QJLConfig.fit_key_scale``).

A coded key's score is the exact score plus noise: ``s_hat = s + n``.  With TurboQuant's norm correction
(``<x, x_hat> = ||x||^2``) the noise is orthogonal to the key and the scores are unbiased, but softmax is not
linear: over many coded tokens the largest noisy scores win, and the attention over the codes comes out sharper
than the exact attention.  The estimate of ``s`` from ``s_hat`` that accounts for the noise shrinks it towards the
scores' mean (for Gaussian scores of spread ``tau`` and noise ``sigma``: ``tau^2 / (tau^2 + sigma^2)``); how
much depends on each head's spread of scores, so the factor is measured, not derived:

* at the first flush (the end of prefill when the prompt outgrows the window), the prompt's last ``FIT_ROWS``
  queries of each KV head's query heads attend over the prompt as the cache will hold it -- sinks and heavy tokens
  and the window exact, the tokens just coded with ``gamma * s_hat`` -- and over the prompt with every score exact
  (:func:`scale_error`: the squared error of the attention outputs, exact values everywhere: the keys' part of the
  error alone);
* ``gamma`` is found by successive parabolic interpolation over ``[GAMMA_MIN, GAMMA_MAX]`` for each sequence and
  KV head (:func:`fit_key_scale`: five evaluations);
* the store multiplies every stored key norm of that sequence and KV head by ``gamma`` -- the codes' scores are
  linear in the norm for the codecs that take the fit (TurboQuant MSE and its vector codebooks), so every
  attention path (the reference, SDPA over dequantized keys, the C and Triton kernels) reads the scaled scores
  without a change, and the exact tokens keep their exact scores.  ``GAMMA_MAX`` = 1: no stored norm grows, so
  none can leave its dtype's range.

Each query row attends through its own mask (``scale_error``'s ``visible``, from the attention mask the store saw
with the query: left padding, and a sliding-window layer's window when ``compress_sliding`` compresses it), so a
sliding layer's gamma is fitted to the attention it serves; where no row sees a coded token, gamma stays 1.

Measured on the embedded model (GPL-3, the tuning text; 1.5k context, three seeds; docs/cache.md, "A scale on
the coded keys' scores"): a constant ``gamma`` helps a little near 0.99 and hurts beyond (0.97 or 1.03 raise KL
by 14% and 160% for ``tqv-k3v2``), while the fitted ``gamma`` lowers the 5x point's KL by about a third.
"""

from __future__ import annotations

import torch

__all__ = ["GAMMA_MIN", "GAMMA_MAX", "FIT_ROWS", "scale_error", "fit_key_scale",
           "SCALED_CODECS"]

GAMMA_MIN, GAMMA_MAX = 0.80, 1.00  # the search interval (both ends candidates; at most 1: no stored norm grows)
FIT_ROWS = 16  # the prompt's last queries per query head that the fit reads (32 measured the same, the fit 1.5x slower)
# key codecs whose scores are linear in their stored field "norm" (the fit folds gamma into it)
SCALED_CODECS = ("turboquant_mse", "turboquant_vq")


def _check_parts(query, exact_k, exact_v, coded_k, coded_hat, coded_v, window_k, window_v, coded_visible,
                 visible=None) -> None:
    """ValueError / TypeError naming the argument whose shape or type does not fit :func:`scale_error`'s."""
    if not isinstance(query, torch.Tensor) or query.dim() != 5:
        raise ValueError(f"query must be a [B, H, G, R, D] tensor, got {getattr(query, 'shape', type(query))}")
    b, h, _, _, d = query.shape
    named = {"coded_k": coded_k, "coded_hat": coded_hat, "coded_v": coded_v, "window_k": window_k,
             "window_v": window_v, "exact_k": exact_k, "exact_v": exact_v}
    if (exact_k is None) != (exact_v is None):
        raise ValueError("exact_k and exact_v must be given together (or both None)")
    for name, x in named.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or tuple(x.shape[:2]) != (b, h) or x.shape[3] != d:
            raise ValueError(f"{name} must be a [B={b}, H={h}, n, D={d}] tensor, got {getattr(x, 'shape', type(x))}")
    for group in (("coded_k", "coded_hat", "coded_v"), ("window_k", "window_v"), ("exact_k", "exact_v")):
        sizes = {named[n].shape[2] for n in group if named[n] is not None}
        if len(sizes) > 1:
            raise ValueError(f"{', '.join(group)} must hold the same number of tokens, got {sorted(sizes)}")
    n = coded_k.shape[2]
    if coded_visible is not None and (not isinstance(coded_visible, torch.Tensor) or coded_visible.dtype != torch.bool
                                      or tuple(coded_visible.shape) != (b, n)):
        raise ValueError(f"coded_visible must be None or a bool [B={b}, n={n}] tensor, got "
                         f"{getattr(coded_visible, 'dtype', type(coded_visible))} {getattr(coded_visible, 'shape', '')}")
    if visible is not None:
        m = query.shape[2] * query.shape[3]
        slots = (0 if exact_k is None else exact_k.shape[2]) + n + window_k.shape[2]
        if (not isinstance(visible, torch.Tensor) or visible.dtype != torch.bool or visible.dim() != 4
                or visible.shape[0] != b or visible.shape[1] not in (1, h) or tuple(visible.shape[2:]) != (m, slots)):
            raise ValueError(f"visible must be None or a bool [B={b}, 1|H={h}, G R={m}, s + n + w={slots}] tensor, got "
                             f"{getattr(visible, 'dtype', type(visible))} {tuple(getattr(visible, 'shape', ()))}")


def scale_error(query, exact_k, exact_v, coded_k, coded_hat, coded_v, window_k, window_v, scaling: float,
                softcap=None, coded_visible=None, visible=None):
    """The squared error of the attention outputs with the coded keys' scores times ``gamma``, against every score
    exact, as a function ``error(gammas)``: gammas [K, B, H] (or broadcastable, e.g. [K, 1, 1]) -> [K, B, H], the
    mean over query rows of ``||o_gamma - o||^2``.  What does not depend on ``gamma`` is computed once here (the
    scores, the exact tokens' part of every output, the exact outputs), so an evaluation costs one exp and one
    [rows, n] x [n, D] product per KV head.

    ``query`` [B, H, G, R, D] float32: each KV head's G query heads' last R queries (row ``r`` at prompt position
    ``P - R + r``); ``exact_k`` / ``exact_v`` [B, H, s, D]: sinks and heavy tokens (seen by every row), or None;
    ``coded_k`` / ``coded_hat`` / ``coded_v`` [B, H, n, D]: the tokens just coded, their keys exact and as coded,
    their exact values (seen by every row: ``R`` is at most the window's length + 1); ``window_k`` / ``window_v``
    [B, H, w, D]: the exact window, the prompt's last ``w`` tokens (row ``r`` sees its first ``w - R + r + 1``);
    ``coded_visible`` [B, n] bool or None: coded slots a row attends (left padding: False).  ``visible`` [B, 1|H,
    G R, s + n + w] bool or None: each query row's own mask over the slots (exact, coded, window; rows ordered by
    query head, then position), e.g. a sliding window's (taken with the causal window and ``coded_visible``); a row
    that sees no slot counts for nothing.  ``softcap``: the model's attention logit softcapping (applied after the
    scale, as the attention applies it)."""
    _check_parts(query, exact_k, exact_v, coded_k, coded_hat, coded_v, window_k, window_v, coded_visible, visible)
    b, h, g, r, d = query.shape
    q = query.reshape(b, h, g * r, d)
    w = window_k.shape[2]
    if r > w + 1:
        raise ValueError(f"the fit's query rows ({r}) must be at most the window's tokens + 1 ({w + 1})")

    def logits(keys):
        return torch.matmul(q, keys.float().transpose(-1, -2)).mul_(scaling)

    def capped(x):
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    row = torch.arange(r, device=q.device).repeat(g)  # row index within its query head, [G R]
    lw = capped(logits(window_k)).masked_fill(torch.arange(w, device=q.device)[None, :] > (w - r + row)[:, None],
                                              float("-inf"))
    lx, vx = lw, window_v.float()  # the exact tokens' scores [B, H, M, s + w] and values
    ns = 0
    if exact_k is not None and exact_k.shape[2]:
        ns = exact_k.shape[2]
        lx, vx = torch.cat([capped(logits(exact_k)), lw], dim=-1), torch.cat([exact_v.float(), vx], dim=2)
    n = coded_k.shape[2]
    if visible is not None:
        vis = visible.to(q.device)
        lx = lx.masked_fill(~torch.cat([vis[..., :ns], vis[..., ns + n:]], dim=-1), float("-inf"))
    mx = lx.amax(-1, keepdim=True)  # [B, H, M, 1]; -inf where a row sees no exact token
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    px = torch.exp(lx - mx)
    nx, zx = torch.matmul(px, vx), px.sum(-1, keepdim=True)  # the exact part of every output, at max mx
    hidden = None if coded_visible is None else ~coded_visible.to(q.device)[:, None, None, :]
    live = None  # with ``visible``: the rows that see some slot [B, H, M]
    if visible is not None:
        rows = ~vis[..., ns:ns + n]  # [B, 1|H, M, n]
        hidden = rows if hidden is None else hidden | rows
        live = (lx > float("-inf")).any(-1) | (~hidden).any(-1)
    s, s_hat, vc = logits(coded_k), logits(coded_hat), coded_v.float()

    def mix(pc, m):  # the codes' weights exp(score - m) and the rows' max m -> the outputs [..., B, H, M, D]
        f = torch.exp(mx - m)
        return (f * nx + torch.matmul(pc, vc)) / (f * zx + pc.sum(-1, keepdim=True))

    def out(coded):  # coded scores [..., B, H, M, n] (capped) -> the outputs
        if hidden is not None:
            coded = coded.masked_fill(hidden, float("-inf"))
        m = torch.maximum(mx, coded.amax(-1, keepdim=True))
        return mix(torch.exp(coded - m), m)

    ref = out(capped(s))
    if softcap is None:  # the scores' max and the exponent in one pass each (gamma > 0: max(gamma x) = gamma max x)
        if hidden is not None:
            s_hat = s_hat.masked_fill(hidden, float("-inf"))
        s_max = s_hat.amax(-1, keepdim=True)

        def scaled(g):  # g [B|1, H|1, 1, 1]
            m = torch.maximum(mx, g * s_max)
            return mix(torch.addcmul(-m, g, s_hat).exp_(), m)
    else:
        def scaled(g):
            return out(capped(g * s_hat))

    def error(gammas) -> torch.Tensor:
        gm = torch.as_tensor(gammas, dtype=torch.float32, device=q.device)
        if live is None:
            return torch.stack([(scaled(x[..., None, None]) - ref).square().sum(-1).mean(-1) for x in gm])
        count = live.sum(-1).clamp(min=1)
        return torch.stack([(scaled(x[..., None, None]) - ref).square().sum(-1).where(live, 0.0).sum(-1) / count
                            for x in gm])

    return error


def _vertex(x: torch.Tensor, e: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """The minimum of the parabola through three points per head: x, e [3, B, H] -> [B, H], within [lo, hi] (the
    best of the three where the parabola opens downwards or is flat)."""
    x0, x1, x2 = x
    e0, e1, e2 = e
    num = (x1 - x0) ** 2 * (e1 - e2) - (x1 - x2) ** 2 * (e1 - e0)
    den = (x1 - x0) * (e1 - e2) - (x1 - x2) * (e1 - e0)
    best = torch.gather(x, 0, e.argmin(0, keepdim=True))[0]
    v = x1 - 0.5 * num / torch.where(den == 0, torch.ones_like(den), den)
    curved = (den * ((x1 - x0) * (x1 - x2) * (x2 - x0)).sign()) > 0  # a minimum, not a maximum
    return torch.where(curved & torch.isfinite(v), v, best).clamp(lo, hi)


def fit_key_scale(error_of, lo: float = GAMMA_MIN, hi: float = GAMMA_MAX) -> torch.Tensor:
    """``gamma`` in [lo, hi] minimizing ``error_of`` for every sequence and KV head at once -> gamma [B, H] float32,
    the best point evaluated.  ``error_of(gammas)``: gammas [K, B, H] (or broadcastable: [K, 1, 1]) -> the error at
    each, [K, B, H] (:func:`scale_error`).  Successive parabolic interpolation, five evaluations in three calls: the
    ends and the middle, the parabola's minimum through them, then the parabola's minimum through that point and
    its two nearest neighbours (near its minimum the error is close to a parabola in ``gamma``).  Where the error is
    the same at every point (no query row sees a coded token), ``hi``: no evidence, no scale below it."""
    if not callable(error_of):
        raise TypeError(f"error_of must be a function of gammas [K, B, H], got {type(error_of).__name__}")
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo!r}, hi={hi!r}")
    x = torch.tensor([lo, (lo + hi) / 2, hi]).view(3, 1, 1)
    e = error_of(x)  # [3, B, H]
    x = x.expand_as(e).clone()
    x3, e3 = x, e
    for _ in range(2):
        v = _vertex(x3, e3, lo, hi)
        x, e = torch.cat([x, v[None]]), torch.cat([e, error_of(v[None])])
        # the best point so far and its two nearest (by gamma), in order: the next parabola's
        near = (x - torch.gather(x, 0, e.argmin(0, keepdim=True))).abs().argsort(0)[:3]
        x3, e3 = torch.gather(x, 0, near), torch.gather(e, 0, near)
        order = x3.argsort(0)
        x3, e3 = torch.gather(x3, 0, order), torch.gather(e3, 0, order)
    best = torch.gather(x, 0, e.argmin(0, keepdim=True))[0].float()
    flat = e.amax(0) == e.amin(0)  # the error does not depend on gamma (no row sees a coded token): no scale
    return torch.where(flat, torch.full_like(best, hi), best)
