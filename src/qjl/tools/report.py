"""Terminal tables, JSON and PNG plots for the command-line reports."""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import torch

__all__ = ["format_table", "write_json", "plot_stats", "plot_codec_stats", "environment", "eval_tables",
           "memory_summary", "qjl_table", "codec_tables"]


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
    """Distortion against bits (log scale) with the TurboQuant paper's values and the upper/lower bounds."""
    rows = result["turboquant"]
    b = [r["bits"] for r in rows]
    fig, (ax1, ax2) = two_panels()
    ax1.semilogy(b, [r["d_mse"] for r in rows], "o-", label="TurboQuant_mse (measured)")
    ax1.semilogy(b, [r["d_mse_paper"] for r in rows], "x", ms=9, label="TurboQuant paper's table")
    ax1.semilogy(b, [r["d_mse_upper"] for r in rows], "k--", label="upper sqrt(3) pi/2 4^-b")
    ax1.semilogy(b, [r["d_mse_lower"] for r in rows], "k:", label="lower 4^-b")
    pol = result["polarquant"]
    ax1.semilogy([p["angle_bits_per_coordinate"] for p in pol], [p["d_mse"] for p in pol], "s-",
                 label="PolarQuant (angle bits / coord)")
    ax2.semilogy(b, [r["d_prod_times_d"] for r in rows], "o-", label="TurboQuant_prod (measured)")
    ax2.semilogy(b, [r["d_prod_theory_times_d"] for r in rows], "+", ms=10, label="(pi/2 - 1/d) D_mse(b-1)")
    ax2.semilogy(b, [r["d_prod_paper_times_d"] for r in rows], "x", ms=9, label="TurboQuant paper's table")
    ax2.semilogy(b, [r["d_prod_upper_times_d"] for r in rows], "k--", label="upper sqrt(3) pi^2 4^-b")
    ax2.semilogy(b, [r["d_prod_lower_times_d"] for r in rows], "k:", label="lower 4^-b")
    ax1.set(xlabel="bits per coordinate b", ylabel="D_mse (unit vectors)", title=f"MSE distortion, d={result['dim']}")
    ax2.set(xlabel="bits per coordinate b", ylabel="d x D_prod (unit query)", title="inner-product distortion")
    save_figure(fig, (ax1, ax2), path)


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def _dppl(value, se) -> str:
    """A perplexity change in percent, with its standard error where there is one: ``+2.08% ±0.85``."""
    text = _f(value, "+.2f") + "%"
    return text if se is None or value is None or math.isnan(se) else f"{text} ±{se:.2f}"


def eval_tables(metrics: dict) -> str:
    """The summary (one row per method) and, for several texts, the per-text detail of a ``qjl eval`` run."""
    results, held = metrics["results"], metrics["held_out"]
    ctxs = sorted({c for r in results.values() for c in r["worst"]}, key=int)
    many = len({t for r in results.values() for t in r["texts"]}) > 1
    headers = ["method", "key", "value", "K+V", "exact"]
    for c in ctxs:
        headers += [f"KL@{c}", f"dppl@{c}", f"top1@{c}"] + ([f"mean dppl@{c}"] if many else [])
    lengths = sorted({n for r in results.values() for n in r.get("passkey", {})}, key=int)
    headers += [f"passkey@{n}" for n in lengths]
    mem_tokens = next((r["memory_at"]["tokens"] for r in results.values() if "memory_at" in r), None)
    if mem_tokens:
        headers += [f"bits@{mem_tokens}", f"x@{mem_tokens}", f"MiB@{mem_tokens}"]
    rows = []
    for name, r in results.items():
        b = r.get("bits", {})
        kb, vb = b.get("key_bits") or None, b.get("value_bits") or None  # "-": nothing compressed
        row = [name, _f(kb, ".2f"), _f(vb, ".2f"), _f((kb + vb) / 2 if kb and vb else None, ".2f"),
               _f(b.get("exact_bits"), ".0f")]
        for c in ctxs:
            w = r["worst"].get(c, {})
            row += [_f(w.get("kl", {}).get("value"), ".4f"), _dppl(w.get("dppl", {}).get("value"), w.get("dppl", {}).get("se")),
                    _f(100 * w["top1"]["value"] if "top1" in w else None, ".1f")]
            if many:
                a = r.get("held_mean", {}).get(c, {})
                row.append(_dppl(a.get("dppl"), a.get("se")) if a else "-")
        row += [f"{r['passkey'][n]['hits']}/{r['passkey'][n]['trials']}" if n in r.get("passkey", {}) else "-"
                for n in lengths]
        if mem_tokens:
            m = r.get("memory_at")
            row += [_f(m and m["bits_per_value"], ".2f"), _f(m and m["x_vs_fp16"], ".2f") + "x",
                    _f(m and m["bytes"] / 2**20, ".2f")]
        rows.append(row)
    parts = [format_table(headers, rows), _legend(many, held, mem_tokens)]
    seeded = [(name, r["over_seeds"]) for name, r in results.items() if r.get("over_seeds")]
    if seeded:  # methods run at several seeds (--seeds): their rotations are random draws
        srows = [[name, str(per[c]["seeds"]), c, f"{per[c]['kl']:.4f}", f"{per[c]['kl_max']:.4f}",
                  f"{per[c]['dppl']:+.2f}%", f"{100 * per[c]['top1']:.1f}", f"{per[c]['kl_mean']:.4f}"]
                 for name, per in seeded for c in per]
        parts += ["", "over seeds (each seed a fresh draw of every rotation): means over the seeds of the worst "
                      "held-out text's KL, perplexity change and top-1; the largest worst KL; KL averaged over "
                      "seeds and texts",
                  format_table(["method", "seeds", "context", "worst KL", "max worst KL", "worst dppl", "worst top1%",
                                "mean KL"], srows)]
    if many:
        for c in ctxs:
            detail = []
            for name, r in results.items():
                for text, per in r["texts"].items():
                    if c in per:
                        m = per[c]
                        detail.append([name, text + ("" if text in held else " (tuning)"), f"{m['kl']:.4f}",
                                       f"{m['ppl']:.3f}", _dppl(m["dppl"], m.get("dppl_se")), f"{100 * m['top1']:.1f}"])
            parts += ["", f"context {c}, each text:",
                      format_table(["method", "text", "KL", "ppl", "dppl", "top1%"], detail)]
    for name, r in results.items():  # per-layer codecs chosen from the prompt (auto-*), where reported
        widths = (r.get("memory_at") or {}).get("widths") or next(
            (m["cache"].get("widths") for per in r["texts"].values() for m in per.values()), None)
        if widths and name.startswith("auto-"):
            groups = {}
            for layer, kv in widths.items():
                groups.setdefault(tuple(kv), []).append(layer)
            parts.append(f"{name} widths: " + "; ".join(f"layers {','.join(ls)}: keys {k}, values {v}"
                                                      for (k, v), ls in groups.items()))
    for s in metrics.get("skipped", []):
        parts.append(f"skipped: {s['text']} at context {s['context']}: {s['reason']}")
    return "\n".join(parts)


def _legend(many: bool, held: list, mem_tokens) -> str:
    lines = ["key/value/K+V: bits per value of the compressed tokens (codes, norms, scales, zero points, outlier "
             "indices); exact: bits per value of the exact sinks, heavy tokens and window (their dtype)."]
    if many:
        lines.append(f"KL/dppl/top1: the WORST over the held-out texts ({', '.join(held)}); each text below. "
                     "mean dppl: the average over them, ± its standard error.")
    lines.append("dppl: perplexity change against full precision, ± its standard error (paired per-token NLL "
                 "differences, means of 16-token blocks): over 512 scored tokens a few copied tokens can move it by "
                 "a point (--segments N pools N windows of each text).")
    if mem_tokens:
        lines.append(f"bits@{mem_tokens}: every byte held for {mem_tokens} tokens (window included) per value; "
                     f"x@{mem_tokens}: fp16 bytes of those tokens / bytes held; MiB: bytes held.")
    return "\n".join(lines)


def memory_summary(report: dict) -> str:
    """One readable line from :meth:`qjl.QJLCache.memory_report`: bytes by part, bits, ratios."""
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    parts = [f"key codes {mib(report['key_code_bytes'])}", f"value codes {mib(report['value_code_bytes'])}",
             f"exact sinks, heavy tokens + window {mib(report['exact_bytes'])}"]
    if report.get("uncompressed_layer_bytes"):
        parts.append(f"uncompressed layers {mib(report['uncompressed_layer_bytes'])}")
    x = report["compression_vs_fp16"]
    ratio = f"{x:.2f}x smaller than fp16" if x >= 1 else f"{1 / x:.2f}x larger than fp16"
    coded = (f"compressed part {report['key_bits']:.2f} key / {report['value_bits']:.2f} value bits"
             if report["key_code_bytes"] else "nothing compressed yet")
    line = (f"cache holds {mib(report['bytes'])} ({', '.join(parts)}); {coded}; "
            f"{report['bits_per_value']:.2f} bits per value with everything counted; {ratio}")
    if report.get("compression_vs_baseline"):  # the model's own cache at its dtype, where the report states it
        line += f", {report['compression_vs_baseline']:.2f}x smaller than the model's own cache"
    return line


def qjl_table(result: dict) -> str:
    """The `qjl stats --part qjl` table."""
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
    return format_table(headers, rows)


def codec_tables(result: dict) -> str:
    """The `qjl stats --part codecs` tables."""
    tq = [[r["bits"], f"{r['d_mse']:.4f}", f"{r['d_mse_codebook']:.4f}", f"{r['d_mse_paper']:.3f}",
           f"{r['d_mse_upper']:.4f}", f"{r['d_mse_lower']:.4f}", f"{r['d_prod_times_d']:.4f}",
           f"{r['d_prod_theory_times_d']:.4f}", f"{r['d_prod_paper_times_d']:.3f}",
           f"{r['d_prod_upper_times_d']:.4f}", f"{r['d_prod_lower_times_d']:.4f}"] for r in result["turboquant"]]
    pq = [["/".join(map(str, p["bits_per_level"][:2])) + "/...", f"{p['angle_bits_per_coordinate']:.3f}",
           f"{p['bits_per_coordinate_with_norm']:.3f}", f"{p['d_mse']:.4f}"] for p in result["polarquant"]]
    return "\n".join([
        format_table(["b", "D_mse", "Lloyd-Max", "paper", "upper", "lower", "d*D_prod", "theory", "paper",
                      "upper", "lower"], tq),
        "D_prod: Gaussian QJL sketch with k = d on the residual; theory (pi/2 - 1/d) * D_mse(b-1).",
        "",
        format_table(["PolarQuant levels", "angle bits/coord", "with fp32 norm", "D_mse"], pq),
    ])
