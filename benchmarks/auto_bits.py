"""``QJLConfig.auto``: does its error proxy rank configurations as the measured KL does, and what does it cost?

A measurement, not a test.  On the embedded model (the ``qjl eval`` protocol: prefill ``--context``
tokens, score 512 in chunks of 32 against the full-precision cache):

1. ranking: a prefill under ``QJLConfig.auto`` records each layer's proxy terms (``S_K``, ``S_V`` and each
   candidate's distortion).  For a set of fixed configurations inside the candidate set (uniform widths
   and half-model splits) the proxy predicts a total error; each is then measured (KL).  Prints Spearman's
   rank correlation between predicted error and KL.
2. per layer (``--per-layer keys|values``): one layer at a time coded at the lowest candidate width for that role
   (the others at the highest), the measured KL increase against the proxy's prediction for that layer, unweighted
   (errors at the attention output) and weighted (AutoBits ``residual_weights``: errors in the residual stream).
   Prints the spread (standard deviation of log(measured / predicted) over the layers) of both, and the slope of
   log(measured / unweighted prediction) against log(weight) (the first-order theory says 1).
3. cost: the time spent building the candidates, measuring and allocating (``candidate_codecs``,
   ``Allocator.observe``, ``Allocator.allocate``) and fitting the coded keys' scale (``LayerStore._fit_scale``,
   ``fit_key_scale``: every auto's default since 2026-11-30) against the whole prefill of the same prompt and one
   step after it (where an allocation's pending first flush runs; since 2026-11-30, before which the prefill alone), at
   ``--cost-contexts`` (median of ``--repeats`` runs), beside the prefill times of a fixed preset (``tq-k3v3``) and
   of ``auto`` with scalar key codebooks (the default's keys use vector codebooks: their nearest-codeword search
   is in C, ``qjl_vq_nearest`` / ``qjl_vq_nearest_grid``).

    python benchmarks/auto_bits.py --rank --cost-contexts 1536,8192
    python benchmarks/auto_bits.py --smooth --cost-contexts 1536 --preset tqa-5x   # a preset with an allocation
    python benchmarks/auto_bits.py --per-layer keys --preset tqa-5x               # layers one at a time (~4 min)

Writes ``<out>/auto-bits-<time>/{config.json,metrics.json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


from qjl.integrations.transformers.names import cache_kwargs

def _spearman(a, b) -> float:
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def _configs(auto, n_layers):
    """name -> (QJLConfig with fixed widths, per-layer picks into the auto candidates)."""
    from qjl import QJLConfig

    kc, vc = auto.key_candidates, auto.value_candidates
    kidx = {s.params["bits"]: i for i, s in enumerate(kc)}
    vidx = {(s.params["bits"], s.params.get("norm_dtype", "fp16")): i for i, s in enumerate(vc)}
    out = {}
    for kb in (2, 3, 4, 5):
        for vb in (2, 3, 4):
            picks = [(kidx[kb], vidx[vb, "fp16"])] * n_layers
            out[f"k{kb}v{vb}"] = (QJLConfig(key=kc[kidx[kb]], value=vc[vidx[vb, "fp16"]], late_key=None), picks)
    half = n_layers // 2
    for lo, hi in (("early", range(half)), ("late", range(half, n_layers))):
        over = {i: {"key": kc[kidx[2]]} for i in hi}
        picks = [(kidx[2] if i in hi else kidx[4], vidx[3, "fp16"]) for i in range(n_layers)]
        out[f"k4v3, 2-bit keys {lo} half"] = (QJLConfig(key=kc[kidx[4]], value=vc[vidx[3, "fp16"]], late_key=None,
                                                         layer_overrides=over), picks)
    return out


def rank(model, tok, text, context, score, smooth) -> dict:
    from dataclasses import replace

    from qjl import QJLCache, QJLConfig
    from qjl.cache.allocation import predicted_error
    from qjl.tools.evaluate import EvalSetup, evaluate_method, load_text_ids

    setup = EvalSetup(context=context, score=score)
    ids, _ = load_text_ids(tok, text, setup.tokens)
    auto_cfg = QJLConfig.auto(bits_per_value=3.0, smooth_keys=smooth)
    cache = QJLCache(model, auto_cfg)
    model(ids[:context].unsqueeze(0), **cache_kwargs(cache))
    stores = [layer.store for layer in cache.layers if hasattr(layer, "store")]
    stats = [s.auto_stats for s in stores]
    ref_m, ref = evaluate_method(model, ids, setup, None)
    rows = []
    for name, (cfg, picks) in _configs(auto_cfg.allocation, len(stores)).items():
        cfg = replace(cfg, smooth_keys=smooth)
        m, _ = evaluate_method(model, ids, setup, cfg, ref)
        rows.append({"config": name, "predicted": predicted_error(stats, picks), "kl": m["kl"],
                     "ppl_delta_pct": 100 * (m["ppl"] / ref_m["ppl"] - 1), "bits_per_value": m["compressed_bits"]})
        print(f"  {name:28s} predicted {rows[-1]['predicted']:10.4g}  KL {m['kl']:.4f}", flush=True)
    m, _ = evaluate_method(model, ids, setup, auto_cfg, ref)
    rho = _spearman([r["predicted"] for r in rows], [r["kl"] for r in rows])
    print(f"Spearman(predicted, KL) = {rho:.3f} over {len(rows)} configurations; auto(3.0): KL {m['kl']:.4f}")
    return {"rows": rows, "spearman": rho, "auto_kl": m["kl"], "auto_bits": m["compressed_bits"]}


def per_layer(model, tok, text, context, score, role, preset) -> dict:
    """Each layer alone at the lowest ``role`` width: measured KL increase against the proxy's prediction."""
    import math
    from dataclasses import replace

    from qjl import QJLCache, QJLConfig
    from qjl.tools.evaluate import EvalSetup, evaluate_method, load_text_ids

    setup = EvalSetup(context=context, score=score)
    ids, _ = load_text_ids(tok, text, setup.tokens)
    auto_cfg = QJLConfig.preset(preset) if preset else QJLConfig.auto(bits_per_value=3.0)
    if auto_cfg.allocation is None or not auto_cfg.allocation.residual_weights:
        raise SystemExit("--per-layer needs an auto configuration with residual_weights (e.g. --preset tqa-5x)")
    cache = QJLCache(model, auto_cfg)
    model(ids[:context].unsqueeze(0), **cache_kwargs(cache))
    stats = [layer.store.auto_stats for layer in cache.layers if hasattr(layer, "store")]
    if not all(st["weighed"] for st in stats):
        raise SystemExit("the model's residual stream could not be read: no weights to compare")
    al = auto_cfg.allocation
    order = lambda specs: sorted(range(len(specs)), key=lambda i: (specs[i].params["bits"],  # noqa: E731
                                                                   specs[i].params.get("norm_dtype") != "fp8"))
    ko, vo = order(al.key_candidates), order(al.value_candidates)
    hi_k, hi_v = ko[-1], vo[-1]
    lo_k, lo_v = (ko[0], hi_v) if role == "keys" else (hi_k, vo[0])
    base = replace(auto_cfg, allocation=None, key=al.key_candidates[hi_k], value=al.value_candidates[hi_v],
                   late_key=None)
    ref_m, ref = evaluate_method(model, ids, setup, None)
    base_kl = evaluate_method(model, ids, setup, base, ref)[0]["kl"]

    def pred(st):
        return (st["s_k"] * (st["keys"][lo_k][1] - st["keys"][hi_k][1])
                + st["s_v"] * (st["values"][lo_v][1] - st["values"][hi_v][1]))

    rows = []
    for i, st in enumerate(stats):
        cfg = replace(base, layer_overrides={i: {"key": al.key_candidates[lo_k], "value": al.value_candidates[lo_v]}})
        m, _ = evaluate_method(model, ids, setup, cfg, ref)
        rows.append({"layer": i, "dkl": m["kl"] - base_kl, "weighted": pred(st),
                     "unweighted": pred(dict(st, **st["unweighed"]))})
        print(f"  layer {i:2d}: KL +{rows[-1]['dkl']:.5f}  predicted {rows[-1]['unweighted']:10.4g} unweighted, "
              f"{rows[-1]['weighted']:10.4g} weighted", flush=True)
    live = [r for r in rows if r["dkl"] > 0 and r["weighted"] > 0 and r["unweighted"] > 0]
    x = torch.tensor([math.log(r["weighted"] / r["unweighted"]) for r in live], dtype=torch.float64)
    yu = torch.tensor([math.log(r["dkl"] / r["unweighted"]) for r in live], dtype=torch.float64)
    yw = torch.tensor([math.log(r["dkl"] / r["weighted"]) for r in live], dtype=torch.float64)
    slope = float(((x - x.mean()) * (yu - yu.mean())).sum() / ((x - x.mean()) ** 2).sum())
    out = {"role": role, "preset": preset, "base_kl": base_kl, "rows": rows, "layers_fitted": len(live),
           "spread_unweighted": float(yu.std()), "spread_weighted": float(yw.std()), "slope": slope}
    print(f"{role}, {len(live)} layers: spread of log(measured / predicted) {out['spread_unweighted']:.2f} "
          f"unweighted, {out['spread_weighted']:.2f} weighted; slope of log(measured / unweighted) on log(weight) "
          f"{slope:.2f}")
    return out


def cost(model, tok, text, context, repeats, smooth, preset=None) -> dict:
    """Prefill times and the allocation's share; ``preset``: a preset with an allocation (e.g. ``tqa-5x``) timed in
    place of ``auto(3.0)`` with vector keys."""
    from qjl import QJLCache, QJLConfig
    from qjl.cache import allocation
    from qjl.tools.evaluate import load_text_ids

    ids = load_text_ids(tok, text, context)[0].unsqueeze(0)
    spent = []
    real_observe, real_allocate = allocation.Allocator.observe, allocation.Allocator.allocate

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[-1] += time.perf_counter() - t
        return wrapper

    real_candidates = allocation.candidate_codecs
    allocation.Allocator.observe, allocation.Allocator.allocate = timed(real_observe), timed(real_allocate)
    allocation.candidate_codecs = timed(real_candidates)
    from qjl.cache.storage import LayerStore

    real_fit = LayerStore._fit_scale  # the coded keys' scale (fit_key_scale, every auto's default): counted too
    LayerStore._fit_scale = timed(real_fit)
    try:
        fixed, scalar, auto, share, share_scalar = [], [], [], [], []
        for _ in range(repeats):
            for cfg, sink in ((QJLConfig.preset("tq-k3v3", smooth_keys=smooth), fixed),
                              (QJLConfig.auto(bits_per_value=3.0, smooth_keys=smooth, vector_keys=False), scalar),
                              (QJLConfig.preset(preset) if preset else
                               QJLConfig.auto(bits_per_value=3.0, smooth_keys=smooth), auto)):
                spent.append(0.0)
                t = time.perf_counter()
                cache = QJLCache(model, cfg)
                model(ids, **cache_kwargs(cache))
                model(ids[:, -1:], **cache_kwargs(cache))  # one step more: a pending allocation flushes here
                sink.append(time.perf_counter() - t)
            share.append(spent[-1] / auto[-1])
            share_scalar.append(spent[-2] / scalar[-1])
    finally:
        allocation.Allocator.observe, allocation.Allocator.allocate = real_observe, real_allocate
        allocation.candidate_codecs = real_candidates
        LayerStore._fit_scale = real_fit
    r = {"context": context, "auto": preset or "auto(3.0)", "prefill_fixed_s": statistics.median(fixed),
         "prefill_auto_s": statistics.median(auto),
         "prefill_auto_scalar_keys_s": statistics.median(scalar), "measure_share": statistics.median(share),
         "measure_share_scalar_keys": statistics.median(share_scalar)}
    print(f"  {context} tokens: prefill tq-k3v3 {r['prefill_fixed_s']:.2f} s, auto with scalar keys "
          f"{r['prefill_auto_scalar_keys_s']:.2f} s, {preset or 'auto (vector keys, the default)'} "
          f"{r['prefill_auto_s']:.2f} s; "
          f"measuring + allocating = {100 * r['measure_share']:.1f}% of the auto prefill "
          f"({100 * r['measure_share_scalar_keys']:.1f}% with scalar keys)", flush=True)
    return r


def main(argv=None) -> int:
    from qjl import patch_attention
    from qjl.tools.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", action="store_true", help="predicted error vs measured KL")
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--score", type=int, default=512)
    p.add_argument("--cost-contexts", default="", help="comma-separated prefill lengths to time (e.g. 1536,8192)")
    p.add_argument("--cost-text", default=None, help="a text long enough for the largest context "
                                                    "(default: this Python's argparse.py)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smooth", action="store_true", help="key smoothing on (QJLConfig(smooth_keys=True))")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default=None, help="with --cost-contexts: time this preset with an allocation (e.g. "
                   "tqa-5x) in place of auto(3.0); with --per-layer: the allocation measured")
    p.add_argument("--per-layer", choices=("keys", "values"), default=None,
                   help="one layer at a time at the lowest width of this role: measured KL against the proxy")
    p.add_argument("--out", default="runs")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    model, tok = load_model()
    patch_attention(model)
    out = Path(a.out) / time.strftime("auto-bits-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vars(a), indent=1))
    metrics = {}
    if a.rank:
        metrics["rank"] = rank(model, tok, a.text, a.context, a.score, a.smooth)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    if a.per_layer:
        metrics["per_layer"] = per_layer(model, tok, a.text, a.context, a.score, a.per_layer, a.preset)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    if a.cost_contexts:
        import argparse as stdlib_argparse

        text = a.cost_text or stdlib_argparse.__file__
        metrics["cost"] = [cost(model, tok, text, int(c), a.repeats, a.smooth, a.preset)
                           for c in a.cost_contexts.split(",")]
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
