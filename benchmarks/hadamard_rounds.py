"""Measure the bias of the "hadamard" QJL family against its number of rounds.

    python benchmarks/hadamard_rounds.py --dim 128 --sketch-dim 256 --seeds 20000

For q = k (the case where a wrong scale shows most) and three keys -- Gaussian,
one-hot, and Gaussian with four 12x outlier channels -- prints the relative bias
of Eq. (4) and its standard error over independent seeds, for 1..4 rounds.
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
    a = p.parse_args()
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


if __name__ == "__main__":
    main()
