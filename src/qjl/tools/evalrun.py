"""One ``qjl eval`` run: methods x texts x contexts under :mod:`qjl.tools.evaluate`'s protocol, passkey
retrieval, memory, the worst held-out text per method, and a run directory (config.json, metrics.json).

Reproducibility: torch (and the C kernel, which follows it) runs with a fixed number of threads (``EvalPlan.threads``, default 2), so a
machine of one kind repeats every number exactly; under another thread count float sums split differently,
which flips a few codes (issue #10 saw `tq-k3v2` at KL 0.0254 / +1.90% on one machine, 0.0255 / +1.83% on
another; ``benchmarks/thread_tolerance.py`` measures the spread).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qjl.tools.evaluate import (EvalSetup, capture_kv, held_kv, load_text_ids, measure_tokens, memory_at,
                                prefill_methods, score_prefilled, tile_kv, token_quality)
from qjl.tools.methods import REFERENCE, make_cache, make_method
from qjl.tools.passkey import passkey_hits_by_method, passkey_prompts

__all__ = ["EvalPlan", "run_eval", "worst_over", "over_seeds", "fix_threads"]


@dataclass(frozen=True)
class EvalPlan:
    """What one run measures.  ``methods`` and ``texts`` are names checked by :func:`qjl.tools.methods.
    resolve_methods` and :func:`qjl.tools.texts.resolve_texts` (the reference method first)."""

    methods: tuple
    texts: tuple = ("gpl-3",)
    contexts: tuple = (1536,)
    score: int = 512
    chunk: int = 32
    passkey_lengths: tuple = (1024,)
    passkey_trials: int = 5
    memory_tokens: int = 4096
    model: str = "smollm2"
    threads: int = 2
    segments: int = 1

    def __post_init__(self):
        if not self.methods or self.methods[0] != REFERENCE:
            raise ValueError(f"methods must start with {REFERENCE!r} (the reference), got {self.methods!r}")
        if not self.texts or not self.contexts:
            raise ValueError("texts and contexts must not be empty")
        for c in self.contexts:
            EvalSetup(context=c, score=self.score, chunk=self.chunk)  # validates
        if isinstance(self.segments, bool) or not isinstance(self.segments, int) or self.segments < 1:
            raise ValueError(f"segments must be a positive int, got {self.segments!r}")
        for name in ("passkey_trials", "memory_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 64 for n in self.passkey_lengths):
            raise ValueError(f"passkey_lengths must be ints >= 64, got {self.passkey_lengths!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be a positive int, got {self.threads!r}")


def worst_over(per_text: dict, texts: list) -> dict:
    """{text: {kl, dppl, top1}} -> the worst value of each metric over ``texts``, with the text it came from (and
    the perplexity change's standard error ``se`` where the text has one)."""
    rows = [(t, per_text[t]) for t in texts if t in per_text]
    if not rows:
        return {}
    out = {}
    for metric, pick in (("kl", max), ("dppl", max), ("top1", min)):
        t, m = pick(rows, key=lambda r: r[1][metric])
        out[metric] = {"value": m[metric], "text": t}
        if metric == "dppl" and m.get("dppl_se") is not None:
            out[metric]["se"] = m["dppl_se"]
    return out


def mean_over(per_text: dict, texts: list) -> dict:
    """{text: {dppl, dppl_se}} -> the perplexity change averaged over ``texts`` with its standard error
    (``sqrt(sum se^2) / n``: the texts are independent samples), {} where a text lacks a standard error."""
    rows = [per_text[t] for t in texts if t in per_text]
    if not rows or any(m.get("dppl_se") is None for m in rows):
        return {}
    n = len(rows)
    return {"dppl": sum(m["dppl"] for m in rows) / n, "se": math.sqrt(sum(m["dppl_se"] ** 2 for m in rows)) / n,
            "texts": n}


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _describe(cfg, model) -> str:
    if cfg is None:
        return "transformers DynamicCache at the model's dtype"
    return cfg.describe(_head_dim(model.config), model.config.num_hidden_layers)


class _Progress:
    """A tqdm bar whose 100% line is printed once (by ``close``), also in a log that keeps every refresh."""

    def __init__(self, total: int, show: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="qjl eval", unit="run", disable=not show, leave=True)

    def update(self, n: int = 1) -> None:
        if self.bar.n + n >= self.bar.total:
            self.bar.n = self.bar.total  # no refresh here: close() shows the final line
        else:
            self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def fix_threads(n: int) -> None:
    """Run torch (and the C kernel, which follows torch) on ``n`` threads: reproducible float sums, and no
    oversubscription on a shared machine."""
    torch.set_num_threads(n)


def run_eval(plan: EvalPlan, out_dir, show_progress: bool = True, model_and_tokenizer=None) -> dict:
    """Run ``plan``; write ``out_dir/config.json`` and ``out_dir/metrics.json``; return the metrics."""
    from qjl.integrations.transformers.attention import patch_attention
    from qjl.tools.models import load_model
    from qjl.tools.report import environment
    from qjl.tools.texts import CORPUS, TUNING_TEXT

    fix_threads(plan.threads)
    torch.set_grad_enabled(False)
    cfgs = {name: make_method(name) for name in plan.methods}
    model, tok = model_and_tokenizer or load_model(plan.model)
    patch_attention(model)
    for cfg in cfgs.values():
        if cfg is not None and hasattr(cfg, "bits_per_value"):
            cfg.bits_per_value(_head_dim(model.config))  # a codec that cannot serve this head size fails now
    need = max(plan.contexts) + plan.score  # one segment's tokens; segment s starts at s * need for every context
    ids, metas, skipped = {}, {}, []
    for text in plan.texts:
        ids[text], metas[text] = _load_segments(tok, text, need, plan.segments, min(plan.contexts) + plan.score)
    held = [t for t in plan.texts if t in CORPUS and t != TUNING_TEXT] or list(plan.texts)
    total = (len(plan.texts) * len(plan.contexts) * len(plan.methods) * plan.segments
             + len(plan.methods) * len(plan.passkey_lengths) * plan.passkey_trials  # one per method and prompt
             + (len(plan.methods) if plan.memory_tokens else 0))
    results = {name: {"config": _describe(cfg, model), "texts": {}} for name, cfg in cfgs.items()}
    bar = _Progress(total, show_progress)
    kv_src = None

    def checkpoint(done: bool = False) -> dict:
        """Summarize what is measured so far and write the run directory (``partial`` until the end)."""
        _summarize(results, held)
        metrics = {"results": results, "texts": metas, "held_out": held, "skipped": skipped, "partial": not done,
                   "environment": {**environment(), "threads": plan.threads}}
        _write(plan, cfgs, model, metas, metrics, out_dir)
        return metrics

    for text in plan.texts:
        for ctx in plan.contexts:
            setup = EvalSetup(context=ctx, score=plan.score, chunk=plan.chunk)
            starts = [s * need for s in range(plan.segments) if s * need + setup.tokens <= ids[text].numel()]
            bar.update(len(plan.methods) * (plan.segments - len(starts)))
            if not starts:
                skipped.append({"text": text, "context": ctx, "reason": f"the text has fewer than "
                                f"{setup.tokens} tokens"})
                continue
            cols, secs = {name: [] for name in cfgs}, dict.fromkeys(cfgs, 0.0)
            for start in starts:
                window = ids[text][start: start + setup.tokens]
                ref = None  # the reference's group comes first: every other method is measured against it
                for name, cache, first in prefill_methods(model, window[:ctx], cfgs):
                    logp, sec = score_prefilled(model, window, setup, cache, first)
                    cols[name].append(token_quality(logp, window[ctx: setup.tokens], ref))
                    secs[name] += sec
                    if name == REFERENCE:
                        ref = logp
                        if (start == 0 and text == plan.texts[0] and plan.memory_tokens
                                and (kv_src is None or ctx > kv_src[1])):
                            kv_src = (held_kv(cache), ctx)  # real keys and values for the memory measure
                    if start == starts[-1]:  # the bytes held: the last segment's cache
                        joined = {k: torch.cat([c[k] for c in cols[name]]) for k in cols[name][0]}
                        m = measure_tokens(joined, cache, secs[name], (setup.score - 1) * len(starts))
                        if name == REFERENCE:
                            m = {**m, "kl": 0.0, "top1": 1.0}
                        if plan.segments > 1:
                            m["segments"] = len(starts)
                        _record(results[name], text, ctx, m)
                    del cache, logp
                    bar.update(1)
                del ref
            del cols
            checkpoint()  # long runs keep every finished text
    if plan.passkey_trials:
        makers = {name: (lambda cfg=cfg: make_cache(model, cfg)) for name, cfg in cfgs.items()}
        for n in plan.passkey_lengths:
            prompts = passkey_prompts(tok, n, plan.passkey_trials)
            hits = passkey_hits_by_method(model, tok, prompts, makers, on_prompt=lambda: bar.update(len(cfgs)))
            for name in cfgs:
                results[name].setdefault("passkey", {})[str(n)] = {"hits": hits[name], "trials": len(prompts)}
        checkpoint()
    kv = None
    if plan.memory_tokens:  # bytes depend on the token count, not the values: the reference's keys, repeated
        kv = (tile_kv(kv_src[0], plan.memory_tokens) if kv_src is not None
              else capture_kv(model, ids[plan.texts[0]], plan.memory_tokens))
    del kv_src
    for name, cfg in cfgs.items():
        r = results[name]
        if plan.memory_tokens:
            # configurations that read the prompt's queries (an allocation: auto-*, or a config built with
            # QJLConfig.auto) are measured through the model
            r["memory_at"] = memory_at(model, ids[plan.texts[0]], cfg, plan.memory_tokens,
                                       None if getattr(cfg, "allocation", None) is not None else kv)
            bar.update(1)
        checkpoint()
    bar.close()
    return checkpoint(done=True)


def _load_segments(tok, text: str, need: int, segments: int, least: int) -> tuple:
    """The first ``need * segments`` token ids of ``text``, or of as many whole segments as it holds, or (shorter
    than one segment) the ``least`` tokens the shortest context needs -> (ids, meta).  Raises ValueError if even
    those are missing."""
    for k in range(segments, 0, -1):
        try:
            return load_text_ids(tok, text, need * k)
        except ValueError:
            continue
    return load_text_ids(tok, text, least)


def _summarize(results: dict, held: list) -> None:
    """Perplexity change against the reference and the worst held-out text, per method and context."""
    ref = results[REFERENCE]
    for r in results.values():
        for text, per_ctx in r["texts"].items():
            for ctx, m in per_ctx.items():
                ratio = m["ppl"] / ref["texts"][text][ctx]["ppl"]
                m["dppl"] = 100 * (ratio - 1)
                if "dnll_se" in m:  # the reference against itself has none
                    m["dppl_se"] = 100 * ratio * m["dnll_se"]
        ctxs = {c for per in r["texts"].values() for c in per}
        r["worst"] = {c: worst_over({t: per[c] for t, per in r["texts"].items() if c in per}, held)
                      for c in sorted(ctxs, key=int)}
        r["held_mean"] = {c: mean_over({t: per[c] for t, per in r["texts"].items() if c in per}, held)
                          for c in sorted(ctxs, key=int)}
    for base, names in _seed_groups(results).items():
        results[base]["over_seeds"] = over_seeds([results[n] for n in names], held)


def _seed_groups(results: dict) -> dict:
    """{method: [method, method@1, ...]} for the methods run at more than one seed."""
    from qjl.tools.methods import split_seed

    groups = {}
    for name in results:
        base, _ = split_seed(name)
        if base in results:
            groups.setdefault(base, []).append(name)
    return {b: ns for b, ns in groups.items() if len(ns) > 1}


def over_seeds(runs: list, held: list) -> dict:
    """One method at several seeds (each a result with ``texts`` and ``worst``) -> per context the mean over seeds of
    the worst held-out KL, perplexity change and top-1, the KL averaged over seeds and held-out texts, and the
    largest worst-text KL over the seeds: ``{ctx: {"seeds", "kl", "dppl", "top1", "kl_mean", "kl_max"}}``."""
    out = {}
    for c in sorted({c for r in runs for c in r["worst"]}, key=int):
        worst = [r["worst"][c] for r in runs if r["worst"].get(c)]
        if len(worst) != len(runs):
            continue
        kls = [r["texts"][t][c]["kl"] for r in runs for t in held if c in r["texts"].get(t, {})]
        n = len(worst)
        out[c] = {"seeds": n, "kl": sum(w["kl"]["value"] for w in worst) / n,
                  "dppl": sum(w["dppl"]["value"] for w in worst) / n, "top1": sum(w["top1"]["value"] for w in worst) / n,
                  "kl_mean": sum(kls) / len(kls), "kl_max": max(w["kl"]["value"] for w in worst)}
    return out


def _record(r: dict, text: str, ctx: int, m: dict) -> None:
    r["texts"].setdefault(text, {})[str(ctx)] = m
    r.setdefault("bits", {k: m["cache"][k] for k in ("key_bits", "value_bits", "exact_bits")})


def _write(plan: EvalPlan, cfgs: dict, model, metas: dict, metrics: dict, out_dir) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**asdict(plan), "methods": {n: _describe(c, model) for n, c in cfgs.items()}, "texts": metas,
              "protocol": "prefill `context` tokens, score `score` tokens in chunks of `chunk` (qjl.tools.evaluate)"}
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
