"""Terminal tables, JSON and PNG plots for the command-line reports."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

__all__ = ["format_table", "write_json", "plot_stats", "plot_codec_stats", "environment"]


def environment() -> dict:
    """Machine and library versions, written with every report."""
    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()}


def format_table(headers: list, rows: list) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])])


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def two_panels():
    """A figure with two side-by-side axes (matplotlib imported lazily, headless backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, 2, figsize=(11, 4.2))


def save_figure(fig, axes, path) -> None:
    """Grid and legend on every axis, then save as PNG and close."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stats(result: dict, path: Path) -> None:
    """Left: relative RMSE of Eq. (4) against m per family.  Right: Theorem 3.6 score error against 3 eps."""
    fig, (ax1, ax2) = two_panels()
    kinds = sorted({r["kind"] for r in result["rows"]}, key=[r["kind"] for r in result["rows"]].index)
    for kind in kinds:
        rows = [r for r in result["rows"] if r["kind"] == kind]
        ms = [r["sketch_dim"] for r in rows]
        ax1.loglog(ms, [r["rel_rmse"] for r in rows], "o-", label=kind)
        ax2.loglog(ms, [r["attention"]["median_max_rel_err"] for r in rows], "o-", label=f"{kind} (median)")
    ms = [r["sketch_dim"] for r in result["rows"] if r["kind"] == kinds[0]]
    ax1.loglog(ms, [(1.5708 / m) ** 0.5 for m in ms], "k--", label="sqrt(pi/(2m)) (Gaussian, q perp k)")
    ax2.loglog(ms, [r["attention"]["bound_3eps"] for r in result["rows"] if r["kind"] == kinds[0]], "k--",
               label="3 eps (Theorem 3.6)")
    ax1.set(xlabel="sketch dim m", ylabel="RMS |Prod - <q,k>| / (|q| |k|)", title=f"Eq. (4) error, d={result['config']['dim']}")
    ax2.set(xlabel="sketch dim m", ylabel="max_i |S~(i) - S(i)| / S(i)", title="attention-score error (Thm 3.6)")
    save_figure(fig, (ax1, ax2), path)


def plot_codec_stats(result: dict, path: Path) -> None:
    """Distortion against bits (log scale) with seed 003's values and the upper/lower bounds."""
    rows = result["turboquant"]
    b = [r["bits"] for r in rows]
    fig, (ax1, ax2) = two_panels()
    ax1.semilogy(b, [r["d_mse"] for r in rows], "o-", label="TurboQuant_mse (measured)")
    ax1.semilogy(b, [r["d_mse_paper"] for r in rows], "x", ms=9, label="seed 003 table")
    ax1.semilogy(b, [r["d_mse_upper"] for r in rows], "k--", label="upper sqrt(3) pi/2 4^-b")
    ax1.semilogy(b, [r["d_mse_lower"] for r in rows], "k:", label="lower 4^-b")
    pol = result["polarquant"]
    ax1.semilogy([p["angle_bits_per_coordinate"] for p in pol], [p["d_mse"] for p in pol], "s-",
                 label="PolarQuant (angle bits / coord)")
    ax2.semilogy(b, [r["d_prod_times_d"] for r in rows], "o-", label="TurboQuant_prod (measured)")
    ax2.semilogy(b, [r["d_prod_theory_times_d"] for r in rows], "+", ms=10, label="(pi/2 - 1/d) D_mse(b-1)")
    ax2.semilogy(b, [r["d_prod_paper_times_d"] for r in rows], "x", ms=9, label="seed 003 table")
    ax2.semilogy(b, [r["d_prod_upper_times_d"] for r in rows], "k--", label="upper sqrt(3) pi^2 4^-b")
    ax2.semilogy(b, [r["d_prod_lower_times_d"] for r in rows], "k:", label="lower 4^-b")
    ax1.set(xlabel="bits per coordinate b", ylabel="D_mse (unit vectors)", title=f"MSE distortion, d={result['dim']}")
    ax2.set(xlabel="bits per coordinate b", ylabel="d x D_prod (unit query)", title="inner-product distortion")
    save_figure(fig, (ax1, ax2), path)
