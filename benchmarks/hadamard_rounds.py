"""Measure the bias of the "hadamard" QJL family against its number of rounds.

    python benchmarks/hadamard_rounds.py --dim 128 --sketch-dim 256 --seeds 20000
    python benchmarks/hadamard_rounds.py --small-dims --seeds 5000

For q = k (the case where a wrong scale shows most) and three keys -- Gaussian,
one-hot, and Gaussian with four 12x outlier channels -- prints the relative bias
of Eq. (4) and its standard error over independent seeds, for 1..4 rounds.
With --small-dims: the default 3 rounds at n = 4, 8, 16, 32 (m = 32, q = k, a Gaussian key with
one 5x channel) next to the orthogonal family, which is why "hadamard" needs n >= 32.
"""
import argparse

import torch

from qjl import QJLSketch


def keys(dim: int) -> dict:
    g = torch.Generator().manual_seed(1234)
    gauss = torch.randn(dim, generator=g)
    outlier = gauss.clone()
    outlier[:4] *= 12
    return {"gaussian": gauss, "one-hot": torch.eye(dim)[3], "4 outliers x12": outlier}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--sketch-dim", type=int, default=256)
    p.add_argument("--seeds", type=int, default=20000)
    p.add_argument("--small-dims", action="store_true")
    a = p.parse_args()
    if a.small_dims:
        return small_dims(a.seeds)
    ks = keys(a.dim)
    batch = torch.stack(list(ks.values()))  # [K, d]
    for rounds in (1, 2, 3, 4):
        est = torch.empty(a.seeds, len(ks), dtype=torch.float64)
        for s in range(a.seeds):
            sk = QJLSketch(a.dim, a.sketch_dim, kind="hadamard", seed=s, norm_dtype="fp32", hadamard_rounds=rounds)
            codes = sk.quantize(batch)
            est[s] = torch.stack([sk.inner_product(batch[i:i + 1], codes.narrow(0, i, 1))[0, 0] for i in range(len(ks))]).double()
        true = (batch.double() ** 2).sum(-1)
        rel = est / true
        for i, name in enumerate(ks):
            m, se = rel[:, i].mean().item() - 1, rel[:, i].std().item() / a.seeds ** 0.5
            z = m / se if se > 0 else float("inf")
            print(f"rounds={rounds} key={name:15s} bias={m * 100:+.3f}%  se={se * 100:.3f}%  ({z:+.1f} se)")


def small_dims(seeds: int) -> None:
    for d in (4, 8, 16, 32):
        g = torch.Generator().manual_seed(1)
        k = torch.randn(d, generator=g)
        k[0] *= 5
        for kind in ("hadamard", "orthogonal"):
            est = torch.empty(seeds, dtype=torch.float64)
            for s in range(seeds):
                # dims below 17 are refused for "hadamard" by the constructor; build it past the check
                sk = _sketch(d, kind, s)
                est[s] = sk.inner_product(k[None], sk.quantize(k[None]))[0, 0]
            true = float(k @ k)
            m, se = est.mean().item() / true - 1, est.std().item() / true / seeds ** 0.5
            print(f"n={d:3d} {kind:10s} bias={m * 100:+.3f}%  se={se * 100:.3f}%")


def _sketch(d: int, kind: str, seed: int) -> QJLSketch:
    import qjl.sketch as sketch_module

    saved = sketch_module._HADAMARD_MIN_N
    sketch_module._HADAMARD_MIN_N = 1
    try:
        return QJLSketch(d, 32, kind=kind, seed=seed, norm_dtype="fp32")
    finally:
        sketch_module._HADAMARD_MIN_N = saved


if __name__ == "__main__":
    main()
