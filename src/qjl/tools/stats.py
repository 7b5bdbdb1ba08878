r"""Monte-Carlo checks of the QJL estimator against the paper's theory (``qjl stats``).

For each sketch family and sketch size m, with independent seeds:

* bias of Eq. (4) in standard errors, over several (q, k) pairs (Lemma 3.2);
* variance against the Gaussian-row theory ``(pi/2 ||q||^2 ||k||^2 - <q,k>^2) / m``;
* the tail ``P(|Prod - <q,k>| > eps ||q|| ||k||)`` against Lemma 3.5's bound as printed,
  ``2 exp(-3/4 m eps^2 / (1 + eps))``, and the corrected bound
  ``2 exp(-m eps^2 / (pi + 4 eps / 3))`` (same Bernstein inequality, with the
  second moment ``E z^2 = pi/2 ||q||^2 ||k||^2`` that the printed proof drops);
* Theorem 3.6: the largest relative attention-score error on a synthetic row of
  n keys of norm <= r against ``3 eps`` with ``eps = r sqrt(2 log n / m)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from qjl.codecs.sketch import KINDS, QJLSketch

__all__ = ["StatsConfig", "run_stats", "run_codec_stats", "printed_tail_bound", "corrected_tail_bound"]


def printed_tail_bound(m: int, eps: float) -> float:
    """Lemma 3.5 as printed in the QJL paper, arXiv:2406.03482 (with the sign of the exponent fixed)."""
    return min(1.0, 2 * math.exp(-0.75 * m * eps ** 2 / (1 + eps)))


def corrected_tail_bound(m: int, eps: float) -> float:
    """Bernstein with v = E z^2 = pi/2 (the paper uses 2/3) and c = 2/3 (Eq. 5), ||q|| ||k|| = 1."""
    return min(1.0, 2 * math.exp(-m * eps ** 2 / (math.pi + 4 * eps / 3)))


@dataclass(frozen=True)
class StatsConfig:
    dim: int = 128
    seeds: int = 1000
    kinds: tuple = KINDS
    ratios: tuple = (0.5, 1, 2, 4)  # sketch_dim / dim
    eps: tuple = (0.1, 0.2, 0.3)
    attn_keys: int = 1024
    attn_radius: float = 2.0

    def __post_init__(self):
        if self.dim < 32 or self.dim % 16:
            raise ValueError(f"dim must be a multiple of 16 and >= 32, got {self.dim}")
        if self.seeds < 100:
            raise ValueError(f"seeds must be >= 100 for meaningful statistics, got {self.seeds}")
        bad = set(self.kinds) - set(KINDS)
        if bad:
            raise ValueError(f"kinds must be among {KINDS}, got {sorted(bad)}")


def _pairs(d: int):
    g = torch.Generator().manual_seed(2024)
    k = torch.randn(d, generator=g)
    out = k.clone()
    out[:4] *= 12
    q = 0.6 * k / k.norm() * 10 + 0.8 * torch.randn(d, generator=g)
    return {"q=k": (k, k), "q~k": (q, k), "outlier key": (q, out)}


def _attention_problem(cfg: StatsConfig):
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(cfg.attn_keys, cfg.dim, generator=g)
    keys = keys / keys.norm(dim=-1, keepdim=True) * cfg.attn_radius * torch.rand(cfg.attn_keys, 1, generator=g).sqrt()
    q = torch.randn(cfg.dim, generator=g)
    q = q / q.norm() * cfg.attn_radius
    return q, keys


def _one_setting(cfg: StatsConfig, kind: str, m: int, pairs: dict, attn, progress) -> dict:
    q_all = torch.stack([p[0] for p in pairs.values()]).unsqueeze(1)
    k_all = torch.stack([p[1] for p in pairs.values()]).unsqueeze(1)
    true = (q_all * k_all).sum(-1).squeeze(1).double()
    scale = (q_all.norm(dim=-1) * k_all.norm(dim=-1)).squeeze(1).double()
    aq, ak = attn
    exact = torch.softmax(ak.double() @ aq.double(), dim=0)
    est = torch.empty(cfg.seeds, len(pairs), dtype=torch.float64)
    attn_err = torch.empty(cfg.seeds, dtype=torch.float64)
    for s in range(cfg.seeds):
        sk = QJLSketch(cfg.dim, m, kind=kind, seed=m * 1_000_000 + s, norm_dtype="fp32")  # disjoint across m
        est[s] = sk.inner_product(q_all, sk.quantize(k_all))[:, 0, 0].double()
        approx = torch.softmax(sk.inner_product(aq[None], sk.quantize(ak))[0].double(), dim=0)
        attn_err[s] = ((approx - exact).abs() / exact).max()
        progress.update(1)
    mean, std = est.mean(0), est.std(0)
    se = std / math.sqrt(cfg.seeds)
    theory = (math.pi / 2 * scale ** 2 - true ** 2) / m
    err = (est - true).abs() / scale
    attn_eps = cfg.attn_radius * math.sqrt(2 * math.log(cfg.attn_keys) / m)
    return {
        "kind": kind, "sketch_dim": m,
        "bias_se": {name: float((mean[i] - true[i]) / se[i]) for i, name in enumerate(pairs)},
        "rel_bias": {name: float(mean[i] / true[i] - 1) for i, name in enumerate(pairs)},
        "var_over_gaussian_theory": {name: float(std[i] ** 2 / theory[i]) for i, name in enumerate(pairs)},
        "rel_rmse": float(err.pow(2).mean().sqrt()),
        "tail": {str(e): {"empirical": float((err > e).double().mean()),
                          "printed_bound": printed_tail_bound(m, e),
                          "corrected_bound": corrected_tail_bound(m, e)} for e in cfg.eps},
        "attention": {"eps": attn_eps, "bound_3eps": 3 * attn_eps,
                      "median_max_rel_err": float(attn_err.median()),
                      "max_rel_err": float(attn_err.max()),
                      "frac_within_bound": float((attn_err <= 3 * attn_eps).double().mean())},
    }


def run_stats(cfg: StatsConfig, show_progress: bool = True) -> dict:
    """Run every (family, sketch size) setting; returns a JSON-ready dict."""
    pairs = _pairs(cfg.dim)
    attn = _attention_problem(cfg)
    sizes = [max(8, int(round(r * cfg.dim / 8)) * 8) for r in cfg.ratios]
    rows = []
    with tqdm(total=len(cfg.kinds) * len(sizes) * cfg.seeds, desc="qjl stats", unit="sketch",
              disable=not show_progress, mininterval=1.0) as progress:
        for kind in cfg.kinds:
            for m in sizes:
                rows.append(_one_setting(cfg, kind, m, pairs, attn, progress))
    cfg_dict = asdict(cfg)
    return {"config": cfg_dict, "pairs": list(pairs), "rows": rows}


# -- the TurboQuant paper's tables: TurboQuant and PolarQuant distortion ---------------------------------------
PAPER_DMSE = {1: 0.36, 2: 0.117, 3: 0.030, 4: 0.009}  # the TurboQuant paper, Thm. 1
PAPER_DPROD = {1: 1.57, 2: 0.56, 3: 0.18, 4: 0.047}  # the TurboQuant paper, Theorem 2's table (times d)
POLAR_SPECS = ((2, 1), (3, 2), (4, 2), (4, 3), (5, 4))


def _unit_vectors(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x / x.norm(dim=-1, keepdim=True)


def run_codec_stats(dim: int = 128, vectors: int = 32000, seeds: int = 16, show_progress: bool = True) -> dict:
    """D_mse and D_prod of TurboQuant for b = 1..4 and PolarQuant's MSE, next to the TurboQuant paper's numbers.

    Unit vectors and unit queries drawn uniformly; each setting averages ``seeds``
    independent codecs over ``vectors // seeds`` vectors each.  D_prod is reported times d.
    """
    from qjl.core.lloyd_max import sphere_codebook
    from qjl.codecs.polarquant import PolarQuant
    from qjl.codecs.turboquant import TurboQuantMSE, TurboQuantProd

    if dim < 16:
        raise ValueError(f"dim must be >= 16, got {dim}")
    per = max(1, vectors // seeds)
    rows, polar = [], []
    total = 4 * 2 * seeds + len(POLAR_SPECS) * seeds
    with tqdm(total=total, desc="codec stats", unit="codec", disable=not show_progress, mininterval=1.0) as bar:
        for b in range(1, 5):
            mse_sq, prod_sq = [], []
            for s in range(seeds):
                x, q = _unit_vectors(per, dim, 10 * s + b), _unit_vectors(per, dim, 10_000 + 10 * s + b)
                c = TurboQuantMSE(dim, b, seed=s, norm_dtype="fp32")
                mse_sq.append((c.dequantize(c.quantize(x)) - x).pow(2).sum(-1))
                bar.update(1)
                p = TurboQuantProd(dim, b, qjl_kind="gaussian", seed=s, norm_dtype="fp32")
                est = p.inner_product(q.unsqueeze(1), p.quantize(x.unsqueeze(1)))[:, 0, 0]
                prod_sq.append((est - (q * x).sum(-1)).pow(2))
                bar.update(1)
            d_mse_prev = 1.0 if b == 1 else dim * sphere_codebook(dim, b - 1).mse
            rows.append({
                "bits": b,
                "d_mse": float(torch.cat(mse_sq).mean()), "d_mse_codebook": dim * sphere_codebook(dim, b).mse,
                "d_mse_paper": PAPER_DMSE[b], "d_mse_upper": math.sqrt(3) * math.pi / 2 * 4.0 ** -b,
                "d_mse_lower": 4.0 ** -b,
                "d_prod_times_d": float(torch.cat(prod_sq).mean()) * dim,
                "d_prod_theory_times_d": (math.pi / 2 - 1 / dim) * d_mse_prev,
                "d_prod_paper_times_d": PAPER_DPROD[b],
                "d_prod_upper_times_d": math.sqrt(3) * math.pi ** 2 * 4.0 ** -b, "d_prod_lower_times_d": 4.0 ** -b,
            })
        for spec in POLAR_SPECS:
            errs = []
            for s in range(seeds):
                x = _unit_vectors(per, dim, 20_000 + s)
                pq = PolarQuant(dim, spec, seed=s, norm_dtype="fp32")
                errs.append((pq.dequantize(pq.quantize(x)) - x).pow(2).sum(-1))
                bar.update(1)
            budget = pq.bit_budget()
            angle_bits = (budget.bits_per_vector - budget.per_vector["norm"]) / dim
            polar.append({"bits_per_level": list(pq.bits), "angle_bits_per_coordinate": angle_bits,
                          "bits_per_coordinate_with_norm": budget.bits_per_coordinate,
                          "d_mse": float(torch.cat(errs).mean())})
    return {"dim": dim, "vectors": per * seeds, "seeds": seeds, "turboquant": rows, "polarquant": polar}
