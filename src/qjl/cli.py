"""Command-line entry point: ``qjl stats`` (more commands join as the project grows)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _stats(args) -> int:
    from .report import environment, format_table, plot_stats, write_json
    from .stats import StatsConfig, run_stats

    cfg = StatsConfig(dim=args.dim, seeds=args.seeds, kinds=tuple(args.kinds))
    t0 = time.time()
    result = run_stats(cfg, show_progress=not args.quiet)
    result["environment"] = environment()
    result["seconds"] = round(time.time() - t0, 1)
    rows = []
    for r in result["rows"]:
        tail = r["tail"]["0.2"]
        att = r["attention"]
        rows.append([
            r["kind"], r["sketch_dim"],
            f"{max(abs(z) for z in r['bias_se'].values()):.2f}",
            f"{r['var_over_gaussian_theory']['q~k']:.3f}",
            f"{r['rel_rmse']:.4f}",
            f"{tail['empirical']:.4f}", f"{tail['printed_bound']:.4f}", f"{tail['corrected_bound']:.4f}",
            f"{att['median_max_rel_err']:.3f}", f"{att['bound_3eps']:.3f}",
        ])
    headers = ["family", "m", "max|bias|/se", "var/theory", "rel RMSE", "P(err>0.2)", "L3.5 printed",
               "L3.5 fixed", "attn err", "3eps"]
    print(f"QJL estimator statistics: d={cfg.dim}, {cfg.seeds} seeds per setting")
    print(format_table(headers, rows))
    print("var/theory: variance over the Gaussian-row formula (pi/2|q|^2|k|^2 - <q,k>^2)/m for q~k (<= 1 expected "
          "for orthogonal/hadamard). L3.5 printed: the paper's tail bound as printed; fixed: with E z^2 = pi/2.")
    out = Path(args.out)
    write_json(out / "stats.json", result)
    plot_stats(result, out / "stats.png")
    print(f"wrote {out / 'stats.json'} and {out / 'stats.png'}")
    return 0


def _paper_budgets(dim: int) -> list:
    """(label, key codec, value codec) for the paper's "3 bits per FPN" setting and variants."""
    from .outliers import OutlierQJL
    from .values import TokenwiseQuantizer

    v2 = TokenwiseQuantizer(dim, bits=2, group_size=32)
    return [
        ("keys m=256, 8 outliers m_out=64; values 2-bit g32", OutlierQJL(dim, 256, 8, 64), v2),
        ("keys m=256, 8 outliers m_out=128; values 2-bit g32", OutlierQJL(dim, 256, 8, 128), v2),
        ("keys m=256, 8 outliers m_out=256; values 2-bit g32", OutlierQJL(dim, 256, 8, 256), v2),
        ("keys m=512 (initial layers), 8 outliers m_out=128; values 2-bit g32", OutlierQJL(dim, 512, 8, 128), v2),
        ("keys m=256, no outliers; values 2-bit g32", OutlierQJL(dim, 256), v2),
    ]


def _bits(args) -> int:
    from .report import format_table

    rows = []
    for label, kc, vc in _paper_budgets(args.dim):
        kb, vb = kc.bit_budget(), vc.bit_budget()
        k_bits = kb.amortized(args.tokens)
        v_bits = vb.amortized(args.tokens)
        rows.append([label, " + ".join(f"{n}:{b}" for n, b in kb.per_vector.items()),
                     f"{k_bits:.3f}", f"{v_bits:.3f}", f"{(k_bits + v_bits) / 2:.3f}", f"{32 / (k_bits + v_bits):.2f}x"])
    print(f"Bits per coordinate at d={args.dim}, shared outlier indices amortized over {args.tokens} tokens "
          f"(full-precision residual tokens not included):")
    print(format_table(["configuration", "key bits per vector", "key", "value", "K+V avg", "vs fp16"], rows))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qjl", description="QJL KV-cache quantization tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stats", help="Monte-Carlo checks of the estimators against the papers' theory")
    p.add_argument("--dim", type=int, default=128, help="vector dimension d (default 128)")
    p.add_argument("--seeds", type=int, default=1000, help="independent sketches per setting (default 1000)")
    p.add_argument("--kinds", nargs="+", default=["gaussian", "orthogonal", "hadamard"], help="sketch families")
    p.add_argument("--out", default="runs/stats", help="run directory for stats.json and stats.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_stats)
    p = sub.add_parser("bits", help="exact bit accounting of the paper's QJL configurations")
    p.add_argument("--dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens the shared outlier indices amortize over")
    p.set_defaults(func=_bits)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"qjl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
