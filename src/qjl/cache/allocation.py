r"""Bits allocated from the prompt: widths per layer and KV head chosen at the end of prefill (``QJLConfig.auto``).

No calibration data: in the prefill's own attention call, each layer measures how much error each
candidate codec would add to its attention output, using the prompt's exact keys ``k_t``, values ``v_t``
and its last ``queries`` queries ``q_r`` (per query head).  Then the widths that minimize the total
predicted error within the budget are chosen (greedy marginal analysis, deterministic), and only then is
anything quantized.

**The error proxy.**  With ``p_rt`` the softmax weights of query r, ``o_r = sum_t p_rt v_t`` and a codec
adding independent errors ``e_t`` to the keys with ``E||e_t||^2 = D_K ||k_t||^2`` spread evenly over the
``d`` coordinates (true for rotation-based codecs: data-oblivious), the first-order change of the output is
``delta o_r = sum_t p_rt delta s_rt (v_t - o_r)`` with ``E delta s_rt^2 = scale^2 ||q_r||^2 D_K ||k_t||^2 / d``,
so

    E||delta o_r||^2 = D_K * S_K,   S_K = scale^2 / d * sum_r ||q_r||^2 sum_t p_rt^2 ||k_t||^2 ||v_t - o_r||^2,

and for value errors ``f_t`` with ``E||f_t||^2 = D_V ||v_t||^2``: ``E||delta o_r||^2 = D_V * S_V``,
``S_V = sum_r sum_t p_rt^2 ||v_t||^2``.  ``S_K``, ``S_V`` come from the prompt (one attention pass of the
last queries over the tokens the prefill compresses); each candidate's relative distortion ``D`` is
measured by quantizing a sample of this layer's own keys and values (``sample_tokens``), so norm dtypes,
key smoothing and codecs that are not rotation-based are all accounted for.  The predicted error of a
layer is ``D_K(key codec) S_K + D_V(value codec) S_V`` (in squared units of the attention output); a layer
kept exact (a candidate for the first and last ``boundary_layers``) predicts 0 and costs the exact dtype's
bits.  ``benchmarks/auto_bits.py`` checks that this proxy ranks configurations as the measured KL does.
A split key codec (:class:`qjl.codecs.split.SplitTurboQuant`) spreads its error unevenly, by design: its ``D_K`` is
measured in the prompt queries' metric instead (:func:`query_weights`; fitted on one half of the last queries,
measured on the other), which for an even spread has the plain ``D_K``'s expectation.

**Per KV head** (``AutoBits.per_head``, the default): each query head reads only its own KV head, so a layer's
output error is the sum of its KV heads' (each with its own ``S_K``, ``S_V`` over its query group) and the
allocation's units are (layer, KV head) pairs, sharing the layer's candidates and distortions; a layer kept exact
is kept so for all its heads.  A layer whose heads get different widths codes each run of adjacent heads with its
own codecs (:meth:`qjl.cache.storage.LayerStore.assign_heads`); the CPU kernel decodes every run in one call
(:class:`qjl.kernels.cpu.launch.DecodeHeads`), the other paths attend run by run.

**Weighing layers** (``AutoBits.residual_weights``, the default).  The terms above are in units of each layer's
attention output, but layers do not weigh alike: the error enters the residual stream through the output projection
and the model downstream sees it relative to the stream (each normalization divides by its RMS), whose norm grows
with depth.  So query head h's rows are weighed by ``gain_h / E||h_l||^2``
(:func:`residual_head_weights`; ``gain_h = ||W_o^(h)||_F^2 / d``, ``h_l`` the residual entering the layer at the last
queries), read from the model in the layer's own attention call (:mod:`qjl.integrations.transformers.residual`).

Cost: one attention pass of ``queries`` rows per layer (:func:`layer_sensitivity`), and the cells of
``sample_tokens`` vectors per candidate width (:func:`distortions`) -- a few percent of the prefill (measured in
docs/cache.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from qjl.cache import padding
from qjl.cache.config import CodecSpec
from qjl.codecs.base import Codec

__all__ = ["AutoBits", "Allocator", "layer_sensitivity", "choose_widths", "candidate_codecs", "predicted_error",
           "planned_budget", "query_weights", "residual_head_weights", "SPLIT_KEYS"]


def _tq(bits, norm="fp16"):
    params = {"bits": bits, "correct_norm": True}
    return CodecSpec("turboquant_mse", params if norm == "fp16" else {**params, "norm_dtype": norm})


def _vector(spec):
    """A TurboQuant MSE spec of 2-4 bits as its vector-codebook twin (``turboquant_vq``, the same parameters)."""
    from qjl.core.vq_codebook import GROUPS

    if spec.name != "turboquant_mse" or spec.params.get("bits", 3) not in GROUPS:
        return spec
    return CodecSpec("turboquant_vq", dict(spec.params), per_dim=dict(spec.per_dim))


def _build(spec, dim: int, seed: int):
    """``spec.build(dim, seed)``; a vector-codebook spec whose group does not divide ``dim`` builds its scalar twin."""
    from qjl.core.vq_codebook import GROUPS

    if spec.name == "turboquant_vq" and dim % GROUPS[spec.params.get("bits", 2)]:
        spec = CodecSpec("turboquant_mse", dict(spec.params), per_dim=dict(spec.per_dim))
    return spec.build(dim, seed)


def _split(share, split_bits, bits):
    """Keys split by importance (:class:`qjl.codecs.split.SplitTurboQuant`): ``share`` of the channels at
    ``split_bits``, the rest at ``bits``, fp8 norms (two per vector)."""
    return CodecSpec("turboquant_split", {"bits": bits, "split_bits": split_bits, "correct_norm": True,
                                          "norm_dtype": "fp8"}, per_dim={"n_split": share})


# split keys (3.0, 3.25, 3.75, 4.25, 4.75 bits per value at d = 64, both fp8 norms counted), for
# ``AutoBits(key_candidates=...)``.  Not among the default candidates: at a fixed width a split beats one rotation at
# equal bits (docs/cache.md), but offered to the allocation at 3 bits per value they measured no better on
# python-source over four seeds (mean KL 0.0087-0.0090 against 0.0079 without them): the allocation traded them
# in where single rotations served as well.
SPLIT_KEYS = (_split(0.25, 5, 2), _split(0.5, 4, 2), _split(0.5, 4, 3), _split(0.5, 5, 3), _split(0.5, 5, 4))


@dataclass(frozen=True)
class AutoBits:
    """Width allocation from the prompt (see the module doc).

    Args:
        bits_per_value: budget, bits per coordinate of the compressed part averaged over keys and values and
            over the compressed layers (the same accounting as ``QJLConfig.bits_per_value``).
        key_candidates, value_candidates: codecs each layer may use (default: TurboQuant MSE with the norm
            correction, keys at 3-6 bits (2-6 below 3 bits per value), values at 2-4 bits with fp16 or fp8 norms;
            :data:`SPLIT_KEYS` may be added to the key candidates).
        queries: the prompt's last queries used to measure each layer.
        boundary_layers: the first and last this many layers may also be kept exact.
        sample_tokens: vectors per layer quantized to measure each candidate's distortion.
        value_cycles: TurboQuant value candidates coded over this many rotations in turn by position
            (:class:`qjl.codecs.turboquant.TurboQuantMSE` ``cycles``; same bits); 1: one rotation.  Default 8:
            on GPL-3 (the tuning text) KL lower at each of three seeds and the perplexity change +1.08% -> +0.40%
            on average; on the held-out texts KL lower on all five (docs/cache.md, "Values over rotations in
            turn").  (The vLLM backend serves such codecs in fixed presets, not ``auto``.)
        vector_keys, vector_values: TurboQuant key / value candidates of 2-4 bits quantize groups of rotated
            coordinates jointly (:class:`qjl.codecs.vq.TurboQuantVQ`, ``turboquant_vq``: a vector codebook, the same
            bits, 13-17% less distortion); False: per-coordinate Lloyd-Max cells.  A head dimension the group (4 at 2
            bits, 2 at 3 and 4) does not divide keeps the scalar codec.  Defaults: vector keys, scalar values: on GPL-3
            (the tuning text; three seeds, four windows) vector keys lowered KL by 12% (0.0056 -> 0.0049) with the
            perplexity change level (+0.35% -> +0.34%), and vector values on top held KL (0.0048) but raised the
            perplexity change at each seed (+0.62% on average) (docs/cache.md, "Vector codebooks").
        budget_tokens: None (default), or the context length at which ``bits_per_value`` is stated for the whole
            cache: a prompt longer than this gives its codes also the bits that the exact tokens' shrinking share
            frees (:meth:`codes_budget`), so that the cache holds at the prompt's length the bits per value, exact
            sinks, heavy tokens and window included, that it holds at ``budget_tokens`` tokens (and fewer as the
            sequence grows).  A prompt of at most this length gets ``bits_per_value``.  The preset ``tqa-5x`` states
            its 5x at 4,096 tokens this way (docs/cache.md, "A budget stated at a length").
        per_head: choose widths per KV head of each layer (the units of the allocation are (layer, KV head) pairs
            with each head's own ``S_K``, ``S_V`` and the layer's distortions; a layer whose heads differ codes each
            run of adjacent heads with its own codecs, :meth:`qjl.cache.storage.LayerStore.assign_heads`) rather than
            per layer.  Default True: the KV heads of one layer differ in sensitivity by up to 100x on the embedded
            model, and per head the proxy's predicted error fell by ~30% at the same bytes; on GPL-3 (the tuning
            text; three seeds, four windows) KL 0.0049 -> 0.0034, lower at each seed, and on the five held-out texts
            at 1.5k KL lower on all five (worst 0.0060 -> 0.0039) and the worst perplexity change +1.15% -> +0.90%
            (docs/cache.md, "Widths per KV head").  Under tensor parallelism every rank gathers every KV head's
            terms (placed by rank offset and summed over the ranks), chooses as one process would and keeps its own
            heads' picks.  Widths stay per layer where a key candidate fits per sequence (split keys).  Cost: the CPU
            kernel decodes every run of a layer in one call (`tqa-5x` per KV head decoded within 1.4% of per layer
            at 8k on a 2-core Zen 3, against 15% with a call per run: docs/cache.md).
        residual_weights: take each layer's predicted error where it lands, in the residual stream and relative to
            it: query head h's terms weighed by ``gain_h / E||h_l||^2``, the output projection's mean squared gain
            over the squared norm of the residual stream entering the layer at the last queries
            (:mod:`qjl.integrations.transformers.residual`; the module doc, "Weighing layers").  Default True: one
            layer at a time at 2 bits, the measured KL per unit of the unweighted proxy fell 100x from layer 1 to
            the embedded model's last layers, and these weights explain it (fitted slope 0.92 for keys, 0.91 for
            values, the first-order theory's 1; ``benchmarks/auto_bits.py --per-layer``); on GPL-3 (the tuning text; three seeds, four windows) KL fell at every seed for ``tqa-5x``
            (0.0060 -> 0.0053) and ``auto(3.0)`` (0.0033 -> 0.0029) (docs/cache.md, "Errors in the residual
            stream").  Where the model's decoder layers or output projection cannot be read the layers stay
            unweighted (``memory_report()["allocation"]`` says which).
    """

    bits_per_value: float
    key_candidates: tuple | None = None
    value_candidates: tuple = field(default_factory=lambda: tuple(
        s for b in (2, 3, 4) for s in (_tq(b, "fp8"), _tq(b))))
    queries: int = 64
    boundary_layers: int = 2
    sample_tokens: int = 512
    value_cycles: int = 8
    vector_keys: bool = True
    vector_values: bool = False
    per_head: bool = True
    budget_tokens: int | None = None
    residual_weights: bool = True

    def __post_init__(self):
        b = self.bits_per_value
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 16:
            raise ValueError(f"bits_per_value must be a number in (0, 16], got {b!r}")
        t = self.budget_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"budget_tokens must be None or an int >= 1, got {t!r}")
        if self.key_candidates is None:
            # 2-bit keys only below 3 bits per value: the proxy (additive per-layer output error) ranks 2-bit keys
            # in the early half like k4v2, but they measure worse than k3v2 (KL 0.027 vs 0.017 on GPL-3,
            # benchmarks/auto_bits.py --rank): early layers' score errors grow through the later layers
            widths = (2, 3, 4, 5, 6) if b < 3 else (3, 4, 5, 6)
            object.__setattr__(self, "key_candidates", tuple(_tq(k) for k in widths))
        for name in ("key_candidates", "value_candidates"):
            specs = tuple(getattr(self, name))
            if not specs or any(not isinstance(s, CodecSpec) for s in specs):
                raise TypeError(f"{name} must be a non-empty sequence of qjl.CodecSpec, got {getattr(self, name)!r}")
            if any(s.name == "kivi" for s in specs):
                raise ValueError(f"{name}: 'kivi' codes groups of tokens; choose per-token codecs")
            object.__setattr__(self, name, specs)
        for name, lo in (("queries", 1), ("boundary_layers", 0), ("sample_tokens", 8), ("value_cycles", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        for name in ("per_head", "residual_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for role in ("keys", "values"):
            if not isinstance(getattr(self, f"vector_{role}"), bool):
                raise ValueError(f"vector_{role} must be a bool, got {getattr(self, f'vector_{role}')!r}")
            if getattr(self, f"vector_{role}"):
                name = f"{role[:-1]}_candidates"
                object.__setattr__(self, name, tuple(_vector(s) for s in getattr(self, name)))
        if self.value_cycles > 1:
            object.__setattr__(self, "value_candidates", tuple(
                CodecSpec(s.name, {**s.params, "cycles": self.value_cycles})
                if s.name in ("turboquant_mse", "turboquant_vq") and "cycles" not in s.params else s
                for s in self.value_candidates))

    def codes_budget(self, length: int, exact: int, exact_bits: float) -> float:
        """Bits per value the codes may use for a prompt of ``length`` tokens of which ``exact`` are held exact at
        ``exact_bits`` (sinks, heavy tokens, window): ``bits_per_value``, or with ``budget_tokens`` = N0 < ``length``
        = L the width that keeps the whole cache's bits per token at L what they are at N0 with ``bits_per_value``:

            (b (L - E) + X E) / L = (bits_per_value (N0 - E) + X E) / N0,  E = exact, X = exact_bits,

        i.e. ``b = ((bits_per_value (N0 - E) + X E) L / N0 - X E) / (L - E)``, which only grows with L (for
        ``bits_per_value`` < X).  Where N0 leaves no compressed tokens (N0 <= E) the budget stays
        ``bits_per_value``."""
        for name, v, lo in (("length", length, 0), ("exact", exact, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if isinstance(exact_bits, bool) or not isinstance(exact_bits, (int, float)) or not exact_bits > 0:
            raise ValueError(f"exact_bits must be a positive number, got {exact_bits!r}")
        n0, b = self.budget_tokens, self.bits_per_value
        if n0 is None or length <= n0 or n0 <= exact:  # (length > n0 > exact: codes at both lengths)
            return float(b)
        per_token = (b * (n0 - exact) + exact_bits * exact) / n0
        return max(float(b), (per_token * length - exact_bits * exact) / (length - exact))

    def describe(self) -> str:
        cyc = f" over {self.value_cycles} rotations in turn" if self.value_cycles > 1 else ""
        vec = [r for r in ("keys", "values") if getattr(self, f"vector_{r}")]
        cyc += f", vector codebooks for {' and '.join(vec)}" if vec else ""
        cyc += ", per KV head" if self.per_head else ", per layer"
        cyc += ", errors in the residual stream" if self.residual_weights else ""
        at = f" (stated for the whole cache at {self.budget_tokens} tokens)" if self.budget_tokens else ""
        return (f"auto widths within {self.bits_per_value:g} bits/value{at} ({len(self.key_candidates)} key, "
                f"{len(self.value_candidates)} value candidates{cyc}, last {self.queries} queries)")


def _compressible(n: int, sinks: int, window: int) -> slice:
    """The prompt tokens the prefill compresses (all but sinks, or also the window if few remain)."""
    return slice(sinks, n - window) if n - window - sinks >= 64 else slice(min(sinks, n), n)


def layer_sensitivity(query, keys, values, mask, scaling: float, tokens: slice, per_head: bool = False,
                      head_weights: torch.Tensor | None = None) -> tuple:
    """``(S_K, S_V)`` of the module doc. query: [B, H_q, R, D]; keys/values: [B, H_kv, L, D] (as stored);
    mask: [B, 1|H_q, R, L] or None; ``tokens``: the positions whose codes would carry the error.  ``per_head``:
    each a list over the KV heads (the sums over each head's query group; they add up to the layer's).
    ``head_weights``: [H_q], each query head's rows weighed (the residual stream's view of the error,
    :func:`residual_head_weights`); None: 1.

    Five passes over the [rows, L] weights: scores, softmax, ``p v``, ``p^2`` and one product of ``p^2`` with
    per-token columns, since ``sum_t p_rt^2 ||k_t||^2 ||v_t - o_r||^2 = a_r - 2 o_r . w_r + ||o_r||^2 c_r``
    with ``a = p^2 (||k||^2 ||v||^2)``, ``w = p^2 (||k||^2 v)``, ``c = p^2 ||k||^2`` (tested against the
    direct sum)."""
    return _sums(*_row_terms(query, keys, values, mask, scaling, tokens), per_head, head_weights)


def _row_terms(query, keys, values, mask, scaling: float, tokens: slice) -> tuple:
    """Per query row, float64 ``[B, H_kv, g * R]`` each (rows of a KV head ordered by query head, then by query):
    the key term ``scaling^2 / d ||q_r||^2 sum_t p_rt^2 ||k_t||^2 ||v_t - o_r||^2`` and the value term
    ``sum_t p_rt^2 ||v_t||^2`` (:func:`layer_sensitivity`)."""
    b, hq, r, d = query.shape
    hkv = keys.shape[1]
    g = hq // hkv
    q = query.float().reshape(b, hkv, g * r, d)
    k, v = keys.float(), values.float()
    logits = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling)  # [B, H_kv, g*R, L]
    if mask is not None:
        # -inf added where hidden ([B, 1|H_q, R, L], small): ~4x faster than a broadcast masked_fill_ over the logits
        hide = torch.zeros(mask.shape, dtype=logits.dtype, device=logits.device).masked_fill_(
            ~padding.visible(mask), float("-inf"))
        hide = hide.unsqueeze(1) if hide.shape[1] == 1 else hide.expand(b, hq, r, -1).reshape(b, hkv, g, r, -1)
        logits.view(b, hkv, g, r, -1).add_(hide)
    p = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    o = torch.matmul(p, v)  # [B, H_kv, g*R, D]
    p2 = p[..., tokens].square()  # [B, H_kv, g*R, T]
    kt, vt = k[:, :, tokens], v[:, :, tokens]
    kn2, vn2 = kt.square().sum(-1, keepdim=True), vt.square().sum(-1, keepdim=True)  # [B, H_kv, T, 1]
    cols = torch.matmul(p2, torch.cat([kn2 * vt, kn2 * vn2, kn2, vn2], dim=-1))  # [B, H_kv, g*R, D + 3]
    w, a, c, s_v = cols[..., :d], cols[..., d], cols[..., d + 1], cols[..., d + 2]
    per_row = (a.double() - 2 * (o * w).sum(-1).double() + o.square().sum(-1).double() * c.double()).clamp(min=0)
    return (scaling ** 2 / d) * q.square().sum(-1).double() * per_row, s_v.double()


def _sums(k_rows, v_rows, per_head: bool, head_weights=None) -> tuple:
    """:func:`_row_terms` summed into ``(S_K, S_V)`` (per KV head: lists), each query head's rows weighed by
    ``head_weights`` [H_q] (None: 1)."""
    if head_weights is not None:
        b, hkv, rows = k_rows.shape
        hw = torch.as_tensor(head_weights, dtype=torch.float64, device=k_rows.device)
        g = hw.numel() // hkv
        if hw.ndim != 1 or g < 1 or hw.numel() != g * hkv or rows % g:
            raise ValueError(f"head_weights must be [H_q], one weight per query head ({hkv} KV heads, {rows} query "
                             f"rows each), got shape {tuple(hw.shape)}")
        hw = hw.view(hkv, g).repeat_interleave(rows // g, dim=1)  # [H_kv, g*R]
        k_rows, v_rows = k_rows * hw, v_rows * hw
    if per_head:
        return k_rows.sum((0, 2)).tolist(), v_rows.sum((0, 2)).tolist()
    return float(k_rows.sum()), float(v_rows.sum())


def residual_head_weights(gain: torch.Tensor, energy: float) -> torch.Tensor:
    """``gain / energy``: a query head's weight in the proxy when its layer's error is taken in the residual stream
    (``gain`` [H_q] the output projection's mean squared gain per head, ``energy`` E||h||^2 of the stream entering
    the layer: :mod:`qjl.integrations.transformers.residual`)."""
    gain = torch.as_tensor(gain, dtype=torch.float64)
    if gain.ndim != 1 or not bool(torch.isfinite(gain).all()) or bool((gain < 0).any()):
        raise ValueError(f"gain must be a 1-d tensor of finite non-negative numbers, got {gain!r}")
    if isinstance(energy, bool) or not isinstance(energy, (int, float)) or not 0 < energy < float("inf"):
        raise ValueError(f"energy must be a positive finite number, got {energy!r}")
    return gain / float(energy)


def _distortion_parts(codec, x: torch.Tensor, *fit, weights: torch.Tensor | None = None) -> tuple:
    """``(sum ||x - x_hat||^2, sum ||x||^2)`` of ``codec`` on ``x: [B, H, n, D]``; with ``weights`` [B, H, D] the
    errors' channels weighed (``sum_i w_i (x_i - x_hat_i)^2``)."""
    xf = x.float()
    e2 = (codec.dequantize(codec.quantize(xf, *fit)) - xf).square()
    err = e2.sum() if weights is None else (e2 * weights.unsqueeze(-2)).sum()
    return float(err), float(xf.square().sum())


def query_weights(queries: torch.Tensor) -> torch.Tensor:
    """Channel weights of the queries' metric: queries [B, H, r, D] -> w [B, H, D], ``w_i = D E[q_i^2] / sum_j
    E[q_j^2]`` (mean 1; uniform for a head whose queries are all zero).  A score's squared error is
    ``sum_i q_i^2 e_i^2``, so ``sum_i w_i e_i^2`` is the key error the scores see, in units where an error spread
    evenly over the channels (a rotation-based codec's) counts its plain ``||e||^2``."""
    from qjl.core.validation import check_vectors

    if not isinstance(queries, torch.Tensor) or queries.ndim < 2 or queries.shape[-2] == 0:
        raise ValueError(f"queries must be a tensor [..., r, D] with r >= 1 rows, got "
                         f"{tuple(getattr(queries, 'shape', ())) or type(queries).__name__}")
    check_vectors("queries", queries, queries.shape[-1], min_ndim=2)
    e = queries.float().square().mean(dim=-2)
    tot = e.sum(-1, keepdim=True)
    return torch.where(tot > 0, e * e.shape[-1] / torch.where(tot > 0, tot, torch.ones_like(tot)), torch.ones_like(e))


def _distortion(codec, x: torch.Tensor, *fit) -> float:
    """Relative distortion sum ||x - x_hat||^2 / sum ||x||^2 of ``codec`` on ``x: [B, H, n, D]``."""
    err, total = _distortion_parts(codec, x, *fit)
    return err / max(total, 1e-30)


def _rotation_key(codec):
    """Candidates whose distortion :func:`distortions` reads from one shared rotation (TurboQuant MSE with an
    unpadded rotation: then ||x - x_hat|| = ||n y - s c[idx]|| in the rotated basis), else None.  A codec over
    rotations in turn (``cycles``) is read through its first rotation: each of its Haar rotations gives the same
    distortion in distribution.  Vector codebooks (:class:`qjl.codecs.vq.TurboQuantVQ`) too: their cells are read by
    their own ``cell_moments``."""
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.codecs.vq import TurboQuantVQ

    if type(codec) not in (TurboQuantMSE, TurboQuantVQ) or codec.rotation.out_dim != codec.dim:
        return None
    return codec.dim, codec.rotation.kind, codec.rotation.seed


def distortions(codecs, x: torch.Tensor, fit: bool = False, parts: bool = False,
                queries: tuple | None = None) -> list:
    """[relative distortion ``sum ||x - x_hat||^2 / sum ||x||^2`` of each codec on ``x: [B, H, n, D]``] (``parts``:
    [(the sum of errors, the sum of ||x||^2)], for summing over ranks first); ``fit``: quantize with each codec's
    per-sequence fit of ``x`` (keys).  ``queries``: (fit rows, metric rows), each [B, H, r, D], the prompt's last
    queries per KV head in two disjoint halves; a codec that fits to queries (``fits_queries``: its error is not
    spread evenly over the channels) is fitted with the first and its error measured in the metric of the second
    (:func:`query_weights`), which for an even spread has the plain error's expectation (two halves: the channels
    chosen for some queries are not judged by those same queries).  TurboQuant MSE candidates that share a rotation
    (a layer's candidates differ only in widths and norm dtypes) rotate ``x`` once; each width's cells are then
    read once as two moments per vector (:func:`qjl.core.lloyd_max.cell_moments`, in C on the CPU; a vector
    codebook's by :meth:`qjl.codecs.vq.TurboQuantVQ.cell_moments`), from which every norm dtype's
    error follows without packing or the inverse rotation: ``||r y - s c||^2 = r^2 - 2 r s cos + s^2 cc`` with
    ``s`` the norm the codec stores (corrected by ``cos`` and rounded to its dtype as the codec does).  Equal to
    the one-by-one path up to float32 rounding (tested)."""
    from qjl.core.validation import check_vectors

    codecs = list(codecs)
    if not codecs:
        return []
    check_vectors("x", x, codecs[0].dim, min_ndim=2)
    xf = x.float()
    total = float(xf.square().sum())
    norm = torch.linalg.vector_norm(xf, dim=-1)
    unit = xf / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1)
    r = norm.double()
    rotated, moments, out = {}, {}, []
    fit_q, weights = (None, None) if queries is None else (queries[0], query_weights(queries[1]))
    for codec in codecs:
        by_queries = codec.fits_queries
        args = (codec.fit(xf, queries=fit_q) if by_queries else codec.fit(xf)) if fit else ()
        key = None if args else _rotation_key(codec)
        if key is None:
            out.append(_distortion_parts(codec, xf, *args, weights=weights if by_queries else None))
            continue
        if key not in rotated:
            rotated[key] = codec.rotation.apply(unit)
        cells = key + (codec.bits, getattr(codec, "group", 1))
        if cells not in moments:
            moments[cells] = (codec.cell_moments(rotated[key]) if hasattr(codec, "cell_moments")
                              else _moments(rotated[key], codec.centroids, codec.boundaries))
        cos, cc = moments[cells]
        s = codec.stored_norm(norm, cos.float()).double()  # the codec's float32 correction and rounding
        err = (r.square() - 2 * r * s * cos + s.square() * cc).clamp(min=0).sum()
        out.append((float(err), total))
    return out if parts else [e / max(t, 1e-30) for e, t in out]


def _moments(y: torch.Tensor, centroids: torch.Tensor, boundaries: torch.Tensor) -> tuple:
    """(cos, cc) of :func:`qjl.core.lloyd_max.cell_moments`, by the C kernel where it serves ``y``."""
    from qjl.core.lloyd_max import cell_moments
    from qjl.kernels.cpu import launch, store

    if y.device.type == "cpu" and launch.available():
        return store.cell_moments(y, boundaries, centroids)
    return cell_moments(y, boundaries.to(y.device), centroids.to(y.device))


def _bits(codec) -> float:
    return codec.bit_budget().amortized(4096)


def choose_widths(stats: list, budget: float, exact_bits: float, boundary: int, heads: int = 1) -> list:
    """Greedy marginal analysis.  stats[u] = {"s_k", "s_v", "keys": [(bits, D)], "values": [(bits, D)]} per unit:
    a layer (``heads=1``), or each KV head of each layer (``heads`` units per layer, layer-major: unit ``u`` is head
    ``u % heads`` of layer ``u // heads``).  Returns per unit ``(key index, value index)``, or ``None`` where its
    layer is kept exact (an option for the first and last ``boundary`` layers, taken for all of a layer's heads at
    once); the mean bits over the units are <= budget."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or len(stats) % heads:
        raise ValueError(f"heads must be a positive int dividing the {len(stats)} units, got {heads!r}")
    n, layers = len(stats), len(stats) // heads
    err = lambda u, role, i: stats[u]["s_" + role[0]] * stats[u][role][i][1]  # noqa: E731
    bits = lambda u, role, i: stats[u][role][i][0]  # noqa: E731
    choice = [{role: min(range(len(stats[u][role])), key=lambda i: (bits(u, role, i), err(u, role, i)))
               for role in ("keys", "values")} for u in range(n)]
    exact = [False] * layers
    unit_cost = lambda u: bits(u, "keys", choice[u]["keys"]) + bits(u, "values", choice[u]["values"])  # noqa: E731
    unit_err = lambda u: err(u, "keys", choice[u]["keys"]) + err(u, "values", choice[u]["values"])  # noqa: E731
    total = sum(unit_cost(u) for u in range(n))
    cap = 2 * budget * n
    if total > cap + 1e-9:
        raise ValueError(f"bits_per_value={budget:g} is below the cheapest candidates ({total / 2 / n:.3f} bits/value)")

    def best_move(u):  # the unit's best affordable move (its key), or None
        l, best = u // heads, None
        options = [(role, i) for role in ("keys", "values") for i in range(len(stats[u][role]))]
        if u % heads == 0 and (l < boundary or l >= layers - boundary):
            options.append(("exact", None))
        for role, i in options:
            if role == "exact":
                units = range(u, u + heads)
                extra = 2 * exact_bits * heads - sum(unit_cost(x) for x in units)
                gain = sum(unit_err(x) for x in units)
            else:
                j = choice[u][role]
                extra, gain = bits(u, role, i) - bits(u, role, j), err(u, role, j) - err(u, role, i)
            if extra <= 0 or gain <= 0 or total + extra > cap + 1e-9:
                continue
            key = (gain / extra, -u, role, -(i or 0))
            if best is None or key > best[0]:
                best = (key, u, role, i, extra)
        return best

    # each unit's best move is kept until its layer changes or the budget left no longer affords it: the budget only
    # shrinks, so an affordable best stays the best affordable (the same choices as re-evaluating every move each time)
    kept, fresh = [None] * n, [False] * n
    while True:
        best = None
        for u in range(n):
            if exact[u // heads]:
                continue
            if not fresh[u] or (kept[u] is not None and total + kept[u][4] > cap + 1e-9):
                kept[u], fresh[u] = best_move(u), True
            if kept[u] is not None and (best is None or kept[u][0] > best[0]):
                best = kept[u]
        if best is None:
            break
        _, u, role, i, extra = best
        if role == "exact":
            exact[u // heads] = True
        else:
            choice[u][role] = i
        total += extra
        first = u - u % heads
        for x in range(first, first + heads):  # (a layer's exact move reads all of its units)
            fresh[x] = False
    return [None if exact[u // heads] else (choice[u]["keys"], choice[u]["values"]) for u in range(n)]


def planned_budget(budget: float, tokens: int, flush_block: int, smooth_keys: bool, key_dim: int,
                   value_dim: int, smooth_values: bool = False, heavy_tokens: int = 0, heads: int = 1,
                   key_scale: bool = False) -> float:
    """Bits per value the codecs may use so that the storage *held* stays within ``budget`` from the end of
    the prefill on (``tokens`` compressed per row then).  Held beyond the codes' own bits:
    the buffers' spare capacity (:func:`qjl.cache.buffers.grown_capacity`: at most ``max(n / 64, step)`` codes
    beyond the ``n`` in use, a fraction that only shrinks as ``n`` grows past ``tokens``), and with key
    smoothing one float32 mean per row and key channel (``32 key_dim / n`` bits per key coordinate), with value
    smoothing one per value channel, with heavy tokens their positions (``heavy_tokens`` int32 per row, shared by the
    ``heads`` KV heads), with ``key_scale`` (``fit_key_scale``) one float32 per row."""
    from qjl.cache.buffers import GROWTH

    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(f"budget must be a positive number, got {budget!r}")
    for name, flag in (("smooth_keys", smooth_keys), ("smooth_values", smooth_values), ("key_scale", key_scale)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    for name, v, lo in (("tokens", tokens, 0), ("flush_block", flush_block, 1), ("key_dim", key_dim, 1),
                        ("value_dim", value_dim, 1), ("heavy_tokens", heavy_tokens, 0), ("heads", heads, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    n = max(tokens, 1)
    spare = 1.0 + max(n // GROWTH, flush_block) / n
    means = 32.0 * (key_dim * smooth_keys + value_dim * smooth_values) / (n * (key_dim + value_dim))
    means += 32.0 * heavy_tokens / (heads * n * (key_dim + value_dim))
    means += 32.0 * key_scale / (n * (key_dim + value_dim))
    return (budget - means) / spare


def candidate_codecs(config, layer_idx: int, key_dim: int, value_dim: int) -> tuple:
    """The candidate codecs of one layer, seeded as the layer's own codecs will be."""
    seed, auto = config.seed + 1000 * layer_idx, config.allocation
    return ([_build(s, key_dim, seed) for s in auto.key_candidates],
            [_build(s, value_dim, seed + 1) for s in auto.value_candidates])


def _gather_heads(store, heads: tuple, device) -> tuple:
    """Per-head ``(S_K list, S_V list)`` of this rank's heads -> those of every rank's heads in the layer's order:
    each rank places its own at its offset (``store.first_head``) and the ranks' vectors are summed
    (``store.rank_sum``)."""
    h, first = len(heads[0]), store.first_head
    full = torch.zeros(2, store.layer_heads, dtype=torch.float64, device=device)
    full[:, first:first + h] = torch.tensor(heads, dtype=torch.float64, device=device)
    full = store.rank_sum(full).tolist()
    return full[0], full[1]


def _head_stats(heads: tuple) -> list:
    """(S_K list, S_V list) over the KV heads -> [{"s_k", "s_v"} per head] (the allocation's units)."""
    return [{"s_k": a, "s_v": b} for a, b in zip(*heads)]


def predicted_error(stats: list, picks: list) -> float:
    """The proxy's total for per-layer picks ``(key index, value index)`` (None: exact, 0 error)."""
    return sum(0.0 if pick is None else st["s_k"] * st["keys"][pick[0]][1] + st["s_v"] * st["values"][pick[1]][1]
               for st, pick in zip(stats, picks))


class Allocator:
    """Measures each compressed layer during the prefill and assigns widths once all are measured."""

    def __init__(self, config, stores: list):
        self.config, self.auto, self.stores = config, config.allocation, stores
        self.choices, self.weighed = None, None

    def reset(self) -> None:
        self.choices, self.weighed = None, None

    def observe(self, store, query, mask, scaling: float, residual: tuple | None = None) -> None:
        """Measure one layer in its prefill attention call (window = the prompt, in position order).  ``residual``:
        ``(gain [H_q], energy)`` of the residual stream this layer's output enters
        (:func:`qjl.integrations.transformers.residual.residual_terms`), or None; with AutoBits ``residual_weights``
        the layer's terms are weighed by :func:`residual_head_weights` (the unweighted ones are kept beside them: a
        layer without them makes :meth:`allocate` use every layer's unweighted terms)."""
        if store.auto_stats is not None:
            return
        keys, values = store.keys, store.values
        r = min(self.auto.queries, query.shape[2])
        m = None if mask is None else mask[:, :, -r:] if mask.shape[2] > 1 else mask
        tokens = _compressible(keys.shape[2], self.config.sink_tokens, self.config.residual_length)
        rows = _row_terms(query[:, :, -r:], keys, values, m, scaling, tokens)
        weights = None
        if self.auto.residual_weights and residual is not None:
            weights = residual_head_weights(residual[0], residual[1])
        per_head = self.per_head(store)

        def layer_terms(w) -> tuple:
            """(S_K, S_V, per-head lists or None) with query-head weights ``w`` (None: unweighted)."""
            if not per_head:
                return (*_sums(*rows, False, w), None)
            heads = _sums(*rows, True, w)  # each KV head's own S_K, S_V (the layer's: their sums)
            if store.ranks is not None:  # every rank's heads, in the layer's head order
                heads = _gather_heads(store, heads, query.device)
            return float(sum(heads[0])), float(sum(heads[1])), heads

        raw = layer_terms(None)
        s_k, s_v, heads = raw if weights is None else layer_terms(weights)
        n = len(range(*tokens.indices(keys.shape[2])))
        pick = torch.linspace(tokens.start, tokens.start + max(n - 1, 0), min(n, self.auto.sample_tokens)).round().long()
        ks, vs = keys[:, :, pick], values[:, :, pick]
        kc, vc = store.candidates
        b, hq, _, d = query.shape
        q5 = query[:, :, -r:].float().reshape(b, keys.shape[1], hq // keys.shape[1], r, d)  # per KV head
        half = r // 2 if r > 1 else r  # fit on the earlier rows, measure on the later ones (disjoint where r > 1)
        qk = (q5[:, :, :, :half].reshape(b, keys.shape[1], -1, d), q5[:, :, :, r - half:].reshape(b, keys.shape[1], -1, d))
        kd, vd = distortions(kc, ks, fit=True, parts=True, queries=qk), distortions(vc, vs, parts=True)
        if store.rank_sum is not None:  # tensor parallelism: every rank's heads, so every rank chooses alike
            flat = store.rank_sum(torch.tensor([s_k, s_v, raw[0], raw[1], *(x for pair in kd + vd for x in pair)],
                                               dtype=torch.float64, device=query.device)).tolist()
            pairs = list(zip(flat[4::2], flat[5::2]))
            if heads is None:  # (per head: s_k, s_v already summed over every rank's heads)
                s_k, s_v, raw = flat[0], flat[1], (flat[2], flat[3], None)
            kd, vd = pairs[:len(kd)], pairs[len(kd):]
        store.auto_stats = {"s_k": s_k, "s_v": s_v, "tokens": n, "length": keys.shape[2],
                            "keys": [(_bits(c), e / max(t, 1e-30)) for c, (e, t) in zip(kc, kd)],
                            "values": [(_bits(c), e / max(t, 1e-30)) for c, (e, t) in zip(vc, vd)],
                            "weighed": weights is not None}
        if heads is not None:  # (with the layer's distortions: the codecs are the same)
            store.auto_stats["heads"] = _head_stats(heads)
        if weights is not None:  # the unweighted terms, for a model where some layer has none (allocate)
            store.auto_stats["unweighed"] = {"s_k": raw[0], "s_v": raw[1]}
            if raw[2] is not None:
                store.auto_stats["unweighed"]["heads"] = _head_stats(raw[2])

    def per_head(self, store) -> bool:
        """Whether widths are chosen per KV head for this store: AutoBits ``per_head``, more than one KV head in
        the layer (over every rank under tensor parallelism, where the store must know its rank: ``store.ranks``),
        and no key candidate with a per-sequence fit (split keys, outlier channels: such a layer keeps one pair of
        codecs)."""
        fitted = any(c.fits_queries or type(c).fit is not Codec.fit for c in store.candidates[0])
        if store.rank_sum is not None and store.ranks is None:
            return False
        return self.auto.per_head and store.layer_heads > 1 and not fitted

    def ready(self) -> bool:
        return self.choices is None and all(s.auto_stats is not None for s in self.stores)

    def allocate(self) -> None:
        live = self.stores
        if not live:
            self.choices = {}
            return
        exact_bits = 8 * live[0].exact_dtype.itemsize
        stats = [s.auto_stats for s in live]
        self.weighed = all(st.get("weighed") for st in stats)
        if not self.weighed:  # (weights for some layers only: none)
            stats = [dict(st, **st["unweighed"]) if st.get("weighed") else st for st in stats]
        nominal = self.auto.bits_per_value
        tokens = min(st["tokens"] for st in stats)
        length = max(st["length"] for st in stats)
        heavy = min(self.config.heavy_tokens, tokens)  # held exact among the compressible tokens
        codes = self.auto.codes_budget(length, length - tokens + heavy, exact_bits)  # (budget_tokens: past N0, more)
        budget = planned_budget(codes, tokens, self.config.flush_block, self.config.smooth_keys,
                                live[0].key_dim, live[0].value_dim, self.config.smooth_values,
                                self.config.heavy_tokens, live[0].heads, self.config.fit_key_scale)
        cheapest = sum(min(b for b, _ in st["keys"]) + min(b for b, _ in st["values"]) for st in stats) / (2 * len(stats))
        if cheapest > nominal + 1e-9:
            raise ValueError(f"bits_per_value={nominal:g} is below the cheapest candidates ({cheapest:.3f} bits/value)")
        if budget < cheapest:
            warnings.warn(f"QJLConfig.auto(bits_per_value={nominal:g}): with {tokens} compressed prompt tokens the "
                          f"smoothing means and the buffers' spare capacity leave {budget:.3f} bits/value for the "
                          f"codes, below the cheapest candidates ({cheapest:.3f}); using those, so the cache holds more "
                          f"than the budget until the context grows", stacklevel=2)
            budget = cheapest
        heads = len(stats[0].get("heads", ()))  # the layer's KV heads (every rank's under tensor parallelism)
        if all(len(st.get("heads", ())) == heads for st in stats) and heads:
            units = [dict(st, **h) for st in stats for h in st["heads"]]
            flat = choose_widths(units, budget, exact_bits, self.auto.boundary_layers, heads=heads)
            picks = [flat[i * heads + s.first_head:i * heads + s.first_head + s.heads] for i, s in enumerate(live)]
        else:
            picks = [[p] * s.heads for p, s in zip(choose_widths(stats, budget, exact_bits,
                                                                  self.auto.boundary_layers), live)]
        self.choices = {}
        for store, pick in zip(live, picks):
            self._assign(store, pick)
            store.candidates = None
            self.choices[store.layer_idx] = pick[0] if len(set(pick)) == 1 else tuple(pick)

    def _assign(self, store, picks: list) -> None:
        """Give ``store`` the codecs of its per-head ``picks`` (all None: kept exact; all alike: one pair for the
        layer; else one pair per run of adjacent KV heads with the same pick)."""
        if picks[0] is None:
            store.assign(None, None)
            return
        kc, vc = store.candidates

        def spec(p):
            return self.auto.key_candidates[p[0]], self.auto.value_candidates[p[1]], (kc[p[0]], vc[p[1]])

        if len(set(picks)) == 1:
            k, v, codecs = spec(picks[0])
            store.assign(k, v, codecs=codecs)
            return
        runs, start = [], 0
        for h in range(1, len(picks) + 1):
            if h == len(picks) or picks[h] != picks[start]:
                runs.append((slice(start, h), *spec(picks[start])))
                start = h
        store.assign_heads(runs)
