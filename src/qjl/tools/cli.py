"""Command-line entry point: ``qjl eval``, ``qjl generate``, ``qjl bench``, ``qjl stats``, ``qjl bits``,
``qjl search-data``, ``qjl search-bench``."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _stats(args) -> int:
    from qjl.tools.report import codec_tables, environment, plot_codec_stats, plot_stats, qjl_table, write_json
    from qjl.tools.stats import StatsConfig, run_codec_stats, run_stats

    out = Path(args.out)
    env = environment()
    if args.part in ("qjl", "all"):
        cfg = StatsConfig(dim=args.dim, seeds=args.seeds, kinds=tuple(args.kinds))
        t0 = time.time()
        result = run_stats(cfg, show_progress=not args.quiet)
        result.update(environment=env, seconds=round(time.time() - t0, 1))
        print(f"QJL estimator statistics: d={cfg.dim}, {cfg.seeds} seeds per setting")
        print(qjl_table(result))
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
        print(codec_tables(result))
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
    from qjl.tools.evalrun import EvalPlan, run_eval
    from qjl.tools.methods import resolve_methods
    from qjl.tools.models import check_model_name
    from qjl.tools.report import eval_tables
    from qjl.tools.texts import resolve_texts

    if args.all and args.methods:
        raise ValueError("give --methods NAME ... or --all, not both")
    # every name is checked here, before the model loads
    plan = EvalPlan(methods=tuple(resolve_methods(args.methods, everything=args.all, seeds=args.seeds)),
                    texts=tuple(resolve_texts(args.texts)), contexts=tuple(args.contexts), score=args.score,
                    chunk=args.chunk, passkey_lengths=tuple(args.passkey_lengths), passkey_trials=args.passkey,
                    memory_tokens=args.memory_tokens, model=args.model, threads=args.threads, segments=args.segments)
    check_model_name(args.model)
    t0 = time.time()
    metrics = run_eval(plan, args.out, show_progress=not args.quiet)
    segs = f" x {plan.segments} segments per text" if plan.segments > 1 else ""
    print(f"model {args.model}; texts {', '.join(plan.texts)}; contexts {', '.join(map(str, plan.contexts))} "
          f"(+{plan.score} scored in chunks of {plan.chunk}{segs}); {plan.threads} threads; {time.time() - t0:.0f} s")
    print(eval_tables(metrics))
    print(f"wrote {args.out}/config.json, {args.out}/metrics.json")
    return 0


_SHORT_PROMPT_NOTE = ("the prompt and answer ({n} tokens) fit in the exact part of the cache ({sinks} sink + "
                      "{window} recent tokens), so nothing is compressed yet: compression starts past {limit} "
                      "tokens (try --prompt-file with a longer text, or the default prompt)")


def _default_prompt() -> str:
    from qjl.tools.texts import load_text

    text, _ = load_text("licenses")
    return ("Here is a software license.\n\n" + text[:6000].rsplit("\n\n", 1)[0]
            + "\n\nIn two sentences: what does this license allow, and what does it require?")


def _generate(args) -> int:
    from qjl.cache.config import QJLConfig
    from qjl.cache.presets import DEFAULT_PRESET
    from qjl.tools.models import check_model_name

    preset = args.preset or DEFAULT_PRESET
    cfg = QJLConfig.preset(preset)  # a bad name fails here, before the model loads
    check_model_name(args.model)
    if args.prompt and args.prompt_file:
        raise ValueError("give --prompt TEXT or --prompt-file PATH, not both")
    text = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt or _default_prompt()
    if not text.strip():
        raise ValueError("the prompt is empty")

    import torch

    from qjl.integrations.transformers.attention import patch_attention
    from qjl.integrations.transformers.cache import QJLCache
    from qjl.integrations.transformers.names import cache_kwargs
    from qjl.tools.models import load_model
    from qjl.tools.report import memory_summary

    torch.set_grad_enabled(False)
    model, tok = load_model(args.model)
    patch_attention(model)
    msgs = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    cache = QJLCache(model, cfg)
    out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=args.max_new_tokens, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    n = cache.get_seq_length()
    print(f"\n[{preset}: {cfg.describe(model.config.head_dim, model.config.num_hidden_layers)}]")
    print(f"[prompt {ids.shape[1]} tokens + {out.shape[1] - ids.shape[1]} generated; {memory_summary(cache.memory_report())}]")
    limit = cfg.sink_tokens + cfg.residual_length
    if n <= limit + cfg.flush_block:
        print("[" + _SHORT_PROMPT_NOTE.format(n=n, sinks=cfg.sink_tokens, window=cfg.residual_length,
                                              limit=limit) + "]")
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


class _Parser(argparse.ArgumentParser):
    """A help given as a function is computed only when help is printed (the preset and method lists
    import torch: building the parser, and a command's own argument errors, stay fast)."""

    def format_help(self):
        for action in self._actions:
            if callable(action.help):
                action.help = action.help()
        return super().format_help()


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default (lists as space-separated values)."""

    def _expand_help(self, action):
        action = copy.copy(action)
        if isinstance(action.default, (list, tuple)):
            action.default = " ".join(map(str, action.default))
        return super()._expand_help(action)

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS or "%(default)" in action.help:
            return action.help
        return action.help + " (default: %(default)s)"


def _preset_help() -> str:
    from qjl.cache.presets import DEFAULT_PRESET, PRESETS

    return f"cache preset, one of: {', '.join(PRESETS)} (default: {DEFAULT_PRESET}, the library's default)"


def _methods_help() -> str:
    from qjl.tools.methods import QUICK_METHODS, method_names

    return (f"methods to compare with full precision (which always runs), from: {', '.join(method_names())}; "
            f"default: the quick set {' '.join(QUICK_METHODS)} ('default' is the default preset)")


def _texts_help() -> str:
    from qjl.tools.texts import CORPUS, TUNING_TEXT

    kinds = ", ".join(f"{n} ({t.kind})" for n, t in CORPUS.items())
    return (f"texts by name or file path: {kinds}; 'held-out' = all but {TUNING_TEXT} (the tuning text), "
            f"'all' = every one")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qjl", description="QJL KV-cache quantization tools",
                                     formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add = lambda name, **kw: sub.add_parser(name, formatter_class=_Formatter, **kw)  # noqa: E731

    p = add("eval", help="quality and memory of cache methods on real text, against full precision (the main job)",
            description="Prefill `context` tokens of each text, score the next `score` tokens in chunks against the "
                        "compressed history; KL, perplexity change and top-1 agreement against full precision, "
                        "passkey retrieval, bits and bytes held. Writes config.json and metrics.json to --out.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--methods", nargs="+", metavar="NAME", help=_methods_help)
    g.add_argument("--all", action="store_true", help="every preset and transformers' QuantizedCache")
    p.add_argument("--texts", nargs="+", default=["gpl-3"], metavar="TEXT", help=_texts_help)
    p.add_argument("--contexts", nargs="+", type=int, default=[1536], metavar="N",
                   help="prompt tokens before scoring (the 8k evaluation: --contexts 1536 7680)")
    p.add_argument("--seeds", type=int, default=1,
                   help="run each of our methods at this many base seeds (name, name@1, ...; fresh rotations) and "
                        "report the means over seeds: at 3 bits one draw moves KL by up to a third")
    p.add_argument("--score", type=int, default=512, help="scored tokens after the prompt")
    p.add_argument("--segments", type=int, default=1,
                   help="evaluate this many disjoint windows of each text (prompt + scored; the s-th starts at s x "
                        "(longest context + score) tokens) and report each text over all of them: a perplexity "
                        "change's standard error shrinks about as 1/sqrt(segments)")
    p.add_argument("--chunk", type=int, default=32, help="tokens per forward pass while scoring")
    p.add_argument("--passkey", type=int, default=5, help="passkey trials per length (0: skip)")
    p.add_argument("--passkey-lengths", nargs="+", type=int, default=[1024], metavar="N",
                   help="passkey prompt lengths in tokens (e.g. 1024 4096)")
    p.add_argument("--memory-tokens", type=int, default=4096, help="measure bytes held at this many tokens (0: skip)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (the embedded model), a model directory or a .gguf")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads (fixed, so numbers repeat exactly on machines of one kind)")
    p.add_argument("--out", default="runs/eval", help="run directory (config.json, metrics.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_eval)

    p = add("generate", help="answer a prompt with a compressed cache and show the memory it holds")
    p.add_argument("--model", default="smollm2", help="'smollm2' (the embedded model), a model directory or a .gguf")
    p.add_argument("--prompt", help="prompt text (default: a question about a ~1.2k-token license text, long "
                                    "enough that most of the cache is compressed)")
    p.add_argument("--prompt-file", help="file holding the prompt")
    p.add_argument("--preset", default=None, help=_preset_help)
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated (greedy)")
    p.set_defaults(func=_generate)

    p = add("bench", help="decode attention, quantization and end-to-end decoding speed, side by side")
    p.add_argument("--parts", default="attention,quantize,e2e",
                   help="comma list of attention,quantize,e2e,vllm")
    p.add_argument("--contexts", default="1024,4096,16384,65536", help="context lengths for decode attention")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per method (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    p.add_argument("--e2e-context", type=int, default=8192, help="prompt tokens for the end-to-end decode")
    p.add_argument("--e2e-tokens", type=int, default=24, help="greedy tokens decoded end to end")
    p.add_argument("--kernel", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="kernel for the compressed caches (auto: the C kernel on CPU, Triton on CUDA)")
    p.add_argument("--out", default="runs", help="parent directory of the run directory")
    p.set_defaults(func=_bench)

    p = add("stats", help="Monte-Carlo checks of the estimators against the papers' theory")
    p.add_argument("--part", choices=["qjl", "codecs", "all"], default="all",
                   help="qjl: bias, variance and tail of the QJL estimator against the QJL paper's lemmas; "
                        "codecs: TurboQuant and PolarQuant distortion against the TurboQuant paper's table")
    p.add_argument("--dim", type=int, default=128, help="vector dimension d")
    p.add_argument("--seeds", type=int, default=1000, help="independent sketches per setting")
    p.add_argument("--kinds", nargs="+", default=["gaussian", "orthogonal", "hadamard"], help="sketch families")
    p.add_argument("--vectors", type=int, default=32000, help="unit vectors per codec setting")
    p.add_argument("--out", default="runs/stats", help="run directory for the JSON files and PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_stats)

    p = add("bits", help="exact bit accounting of the QJL paper's configurations")
    p.add_argument("--dim", type=int, default=128, help="head dimension")
    p.add_argument("--tokens", type=int, default=4096, help="tokens the shared outlier indices amortize over")
    p.set_defaults(func=_bits)
    from qjl.search.cli import add_search_commands  # argparse only: nothing heavy is imported

    add_search_commands(sub)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"qjl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
