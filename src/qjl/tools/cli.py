"""Command-line entry point: ``qjl eval``, ``qjl generate``, ``qjl bench``, ``qjl stats``, ``qjl bits``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _qjl_table(result: dict) -> str:
    from qjl.tools.report import format_table

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


def _codec_tables(result: dict) -> str:
    from qjl.tools.report import format_table

    tq = [[r["bits"], f"{r['d_mse']:.4f}", f"{r['d_mse_codebook']:.4f}", f"{r['d_mse_paper']:.3f}",
           f"{r['d_mse_upper']:.4f}", f"{r['d_mse_lower']:.4f}", f"{r['d_prod_times_d']:.4f}",
           f"{r['d_prod_theory_times_d']:.4f}", f"{r['d_prod_paper_times_d']:.3f}",
           f"{r['d_prod_upper_times_d']:.4f}", f"{r['d_prod_lower_times_d']:.4f}"] for r in result["turboquant"]]
    pq = [["/".join(map(str, p["bits_per_level"][:2])) + "/...", f"{p['angle_bits_per_coordinate']:.3f}",
           f"{p['bits_per_coordinate_with_norm']:.3f}", f"{p['d_mse']:.4f}"] for p in result["polarquant"]]
    return "\n".join([
        format_table(["b", "D_mse", "Lloyd-Max", "seed003", "upper", "lower", "d*D_prod", "theory", "seed003",
                      "upper", "lower"], tq),
        "D_prod: Gaussian QJL sketch with k = d on the residual; theory (pi/2 - 1/d) * D_mse(b-1).",
        "",
        format_table(["PolarQuant levels", "angle bits/coord", "with fp32 norm", "D_mse"], pq),
    ])


def _stats(args) -> int:
    from qjl.tools.report import environment, plot_codec_stats, plot_stats, write_json
    from qjl.tools.stats import StatsConfig, run_codec_stats, run_stats

    out = Path(args.out)
    env = environment()
    if args.part in ("qjl", "all"):
        cfg = StatsConfig(dim=args.dim, seeds=args.seeds, kinds=tuple(args.kinds))
        t0 = time.time()
        result = run_stats(cfg, show_progress=not args.quiet)
        result.update(environment=env, seconds=round(time.time() - t0, 1))
        print(f"QJL estimator statistics: d={cfg.dim}, {cfg.seeds} seeds per setting")
        print(_qjl_table(result))
        print("var/theory: variance over the Gaussian-row formula (pi/2|q|^2|k|^2 - <q,k>^2)/m for q~k (<= 1 expected "
              "for orthogonal/hadamard). L3.5 printed: the paper's tail bound as printed; fixed: with E z^2 = pi/2.")
        write_json(out / "stats.json", result)
        plot_stats(result, out / "stats.png")
        print(f"wrote {out / 'stats.json'} and {out / 'stats.png'}\n")
    if args.part in ("codecs", "all"):
        t0 = time.time()
        result = run_codec_stats(dim=args.dim, vectors=args.vectors, show_progress=not args.quiet)
        result.update(environment=env, seconds=round(time.time() - t0, 1))
        print(f"TurboQuant / PolarQuant distortion: d={args.dim}, {result['vectors']} unit vectors, {result['seeds']} seeds")
        print(_codec_tables(result))
        write_json(out / "codecs.json", result)
        plot_codec_stats(result, out / "codecs.png")
        print(f"wrote {out / 'codecs.json'} and {out / 'codecs.png'}")
    return 0


def _paper_budgets(dim: int) -> list:
    """(label, key codec, value codec) for the paper's "3 bits per FPN" setting and variants."""
    from qjl.codecs.outliers import OutlierQJL
    from qjl.codecs.tokenwise import TokenwiseQuantizer

    v2 = TokenwiseQuantizer(dim, bits=2, group_size=32)
    return [
        ("keys m=256, 8 outliers m_out=64; values 2-bit g32", OutlierQJL(dim, 256, 8, 64), v2),
        ("keys m=256, 8 outliers m_out=128; values 2-bit g32", OutlierQJL(dim, 256, 8, 128), v2),
        ("keys m=256, 8 outliers m_out=256; values 2-bit g32", OutlierQJL(dim, 256, 8, 256), v2),
        ("keys m=512 (initial layers), 8 outliers m_out=128; values 2-bit g32", OutlierQJL(dim, 512, 8, 128), v2),
        ("keys m=256, no outliers; values 2-bit g32", OutlierQJL(dim, 256), v2),
    ]


def _bits(args) -> int:
    from qjl.tools.report import format_table

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


def _eval(args) -> int:
    import json

    import torch
    from tqdm.auto import tqdm

    from qjl.tools.evaluate import (EvalSetup, check_config_for_model, default_methods, evaluate_method, load_text_ids,
                           memory_at, passkey_prompts, quality_vs_bits_plot)
    from qjl.tools.models import load_model
    from qjl.tools.report import environment, format_table, write_json

    torch.set_grad_enabled(False)
    setup = EvalSetup(context=args.context, score=args.score, chunk=args.chunk, passkey_trials=args.passkey)
    methods = default_methods()
    if args.methods:
        unknown = [m for m in args.methods if m not in methods]
        if unknown:
            raise ValueError(f"--methods: unknown {unknown}; choose from {list(methods)}")
        methods = {k: methods[k] for k in ["full precision", *args.methods] if k in methods}
    model, tok = load_model(args.model)
    from qjl.integrations.transformers.attention import patch_attention

    patch_attention(model)
    for cfg in methods.values():
        if cfg is not None:
            check_config_for_model(cfg, model)
    ids = load_text_ids(tok, args.text, setup.context + setup.score + 1)
    prompts = passkey_prompts(tok, setup.passkey_tokens, setup.passkey_trials) if setup.passkey_trials else None
    results, reference = {}, None
    for label, cfg in tqdm(methods.items(), desc="qjl eval", unit="method"):
        m, logp = evaluate_method(model, tok, ids, setup, cfg, reference, prompts)
        if args.memory_tokens:
            m["memory_at"] = {"tokens": args.memory_tokens, **memory_at(model, ids, cfg, args.memory_tokens)}
        if cfg is None:
            reference = logp
            m.update(kl=0.0, top1=1.0)
        results[label] = m
    rows = []
    for label, m in results.items():
        rows.append([label, f"{m.get('compressed_bits', m['bits_per_value']):.2f}", f"{m['key_bits']:.2f}",
                     f"{m['value_bits']:.2f}", f"{m['kl']:.4f}", f"{m['ppl']:.3f}",
                     f"{100 * (m['ppl'] / results['full precision']['ppl'] - 1):+.2f}%", f"{100 * m['top1']:.1f}",
                     f"{m.get('passkey', '-')}/{m.get('passkey_trials', '-')}", f"{m['cache_bytes'] / 2**20:.2f}",
                     f"{m['memory_at']['x_vs_fp16']:.2f}x" if "memory_at" in m else "-", f"{m['tokens_per_s']:.1f}"])
    print(f"model {args.model}; text {args.text}: context {setup.context}, scored {setup.score} tokens in chunks "
          f"of {setup.chunk}")
    print(format_table(["method", "bits/val", "key", "value", "KL", "ppl", "dppl", "top1%", "passkey", "cache MB",
                        f"x@{args.memory_tokens}", "tok/s"], rows))
    print("bits/val: keys+values of the compressed part (codes, norms, scales, zero points, outlier indices); "
          f"cache MB: every tensor held after scoring, exact tokens at their dtype; x@{args.memory_tokens}: fp16 bytes "
          f"of {args.memory_tokens} tokens over the bytes this cache holds for them (exact window included).")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"model": args.model, "text": args.text, **setup.__dict__,
                                                 "methods": {k: (None if v is None else v.describe(
                                                     model.config.head_dim, model.config.num_hidden_layers))
                                                     for k, v in methods.items()}},
                                                indent=2))
    write_json(out / "metrics.json", {"results": results, "environment": environment()})
    quality_vs_bits_plot(results, out / "quality_vs_bits.png")
    print(f"wrote {out}/config.json, metrics.json, quality_vs_bits.png")
    return 0


def _generate(args) -> int:
    import torch

    from qjl.integrations.transformers.attention import patch_attention
    from qjl.integrations.transformers.cache import QJLCache
    from qjl.cache.config import QJLConfig
    from qjl.tools.models import load_model

    torch.set_grad_enabled(False)
    text = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    if not text:
        raise ValueError("give a prompt: --prompt TEXT or --prompt-file PATH")
    model, tok = load_model(args.model)
    patch_attention(model)
    from qjl.cache.presets import DEFAULT_PRESET

    cfg = QJLConfig.preset(args.preset or DEFAULT_PRESET)
    msgs = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    cache = QJLCache(model, cfg)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=args.max_new_tokens, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    r = cache.memory_report()
    print(f"\n[cache: {r['bytes'] / 1024:.1f} KiB for {out.shape[1]} tokens vs {r['fp16_bytes'] / 1024:.1f} KiB at fp16 "
          f"({r['compression_vs_fp16']:.2f}x); compressed part {r['key_bits']:.2f} key / {r['value_bits']:.2f} value bits; "
          f"{cfg.describe(model.config.head_dim, model.config.num_hidden_layers)}]")
    return 0


def _bench(args) -> int:
    import torch

    from qjl.tools.bench import PARTS, main_bench

    torch.set_grad_enabled(False)
    out = Path(args.out) / time.strftime("bench-%Y%m%d-%H%M%S")
    parts = tuple(args.parts.split(","))
    bad = set(parts) - set(PARTS)
    if bad:
        raise SystemExit(f"--parts: unknown part(s) {sorted(bad)}; choose from {','.join(PARTS)}")
    try:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    except ValueError:
        raise SystemExit(f"--contexts: comma-separated token counts, got {args.contexts!r}") from None
    main_bench(out, contexts, args.repeats, args.warmup, args.e2e_context, args.e2e_tokens, parts, args.kernel)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qjl", description="QJL KV-cache quantization tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stats", help="Monte-Carlo checks of the estimators against the papers' theory")
    p.add_argument("--dim", type=int, default=128, help="vector dimension d (default 128)")
    p.add_argument("--seeds", type=int, default=1000, help="independent sketches per setting (default 1000)")
    p.add_argument("--kinds", nargs="+", default=["gaussian", "orthogonal", "hadamard"], help="sketch families")
    p.add_argument("--vectors", type=int, default=32000, help="unit vectors per codec setting (default 32000)")
    p.add_argument("--part", choices=["qjl", "codecs", "all"], default="all",
                   help="qjl: QJL estimator vs paper 001; codecs: TurboQuant/PolarQuant vs seed 003 (default all)")
    p.add_argument("--out", default="runs/stats", help="run directory for the JSON files and PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_stats)
    p = sub.add_parser("bits", help="exact bit accounting of the paper's QJL configurations")
    p.add_argument("--dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens the shared outlier indices amortize over")
    p.set_defaults(func=_bits)
    p = sub.add_parser("eval", help="quality and cost of every cache method on real text (the main job)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded), a model directory or a .gguf file")
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="a UTF-8 text file")
    p.add_argument("--context", type=int, default=1536, help="prompt tokens (default 1536)")
    p.add_argument("--score", type=int, default=512, help="scored tokens after the prompt (default 512)")
    p.add_argument("--chunk", type=int, default=32, help="tokens per forward pass while scoring (default 32)")
    p.add_argument("--passkey", type=int, default=5, help="passkey trials at 1k tokens (0 to skip)")
    p.add_argument("--methods", nargs="+", help="presets to run (default: all); full precision always runs")
    p.add_argument("--memory-tokens", type=int, default=4096, help="measure cache bytes at this length (0 to skip)")
    p.add_argument("--out", default="runs/eval", help="run directory")
    p.set_defaults(func=_eval)
    p = sub.add_parser("bench", help="decode attention / quantization / end-to-end speed, side by side")
    p.add_argument("--parts", default="attention,quantize,e2e",
                   help="comma list of attention,quantize,e2e,vllm (default attention,quantize,e2e)")
    p.add_argument("--contexts", default="1024,4096,16384,65536", help="context lengths for decode attention")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per method (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    p.add_argument("--e2e-context", type=int, default=8192, help="prompt tokens for the end-to-end decode")
    p.add_argument("--e2e-tokens", type=int, default=24, help="greedy tokens decoded end to end")
    p.add_argument("--kernel", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="kernel for the compressed caches (auto: the C kernel on CPU, Triton on CUDA)")
    p.add_argument("--out", default="runs", help="parent directory of the run directory")
    p.set_defaults(func=_bench)
    p = sub.add_parser("generate", help="answer a prompt with a compressed cache and show its memory")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--prompt-file", help="file holding the prompt")
    p.add_argument("--preset", default=None, help="cache preset (see qjl.PRESETS; default: qjl.config.DEFAULT_PRESET)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"qjl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
