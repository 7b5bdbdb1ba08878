"""qjl's vLLM backend against vLLM's native CPU attention, side by side in one run (a benchmark, not a test).

    python benchmarks/vllm_bench.py                       # native, tq-k45v3, tq-k3v2
    python benchmarks/vllm_bench.py --configs native,tq-k45v3,tq-k45v3:sinks=0:window=0 --no-speed
    python benchmarks/vllm_bench.py --configs native,tq-k45v3,tq-k45v3:smooth_keys=0 --no-speed --kl-tokens 384
    python benchmarks/vllm_bench.py --no-quality --no-speed --throughput 24 --chunk 512   # concurrent requests
    python benchmarks/vllm_bench.py --no-quality --no-speed --throughput fit --chunk 512  # as many as each cache fits

Every configuration runs in its own process (the plugin is switched on by the environment) with the
same engine settings: the embedded SmolLM2-135M-Instruct (bf16, or ``--dtype``), ``enforce_eager``, 2 threads, a fixed
``VLLM_CPU_KVCACHE_SPACE`` (GiB), chunked prefill in ``--chunk``-token chunks.  Measured:

* **KL** against native, teacher-forced: ``prompt_logprobs`` of real texts (GPL-3, Apache-2.0, MPL-2.0,
  Python's ``argparse.py``), prefilled in ``--chunk``-token chunks, so every chunk after the first attends
  to compressed history (its own tokens exactly).  vLLM returns the top ``--topk`` log-probabilities per
  position: KL is computed over native's top-k tokens plus one "rest" bucket, a lower bound of the full
  KL (coarse-graining never increases KL); the mean rest mass is reported beside it.  Positions of the
  first chunk (attended exactly by every configuration) are excluded.
* **perplexity** of the real next tokens against native's (exact, from the same prompt logprobs);
* **greedy agreement**: 64 greedy tokens after 8 real-text prompts: identical positions and the mean
  length of the common prefix.
* **KV tokens** that fit in the cache space, as the engine reports them ("KV cache size").
* **decode tokens/s**, one stream, at ``--contexts`` tokens of context (default 1k and 8k), after a warm-up
  that prefills the prompt (then re-read from the prefix cache): N / (engine timestamp of the last token -
  that of the first) of a request generating 1 + N tokens (vLLM's per-request stats: decode steps only, no
  prefill), the median of ``--repeats`` requests; ``diff`` beside it is the older estimate N / (wall time of
  1 + N tokens - wall time of 1 token), which also drops the prefill but is noisier.
* **prefill tokens/s** at the same contexts: ctx / wall time of one fresh request (nothing cached) generating
  one token, in ``--chunk``-token chunks (the time to first token of a request alone).  The load average before
  and after each configuration is recorded (configurations run one after the other, not interleaved).

* **throughput** (``--throughput N``): the same workload for every configuration at the same cache space: N
  requests at once, each a distinct ``--tp-prompt``-token real-text prompt (no shared prefix) generating
  ``--tp-gen`` tokens (``ignore_eos``); total generated tokens / wall time of the whole batch.  A cache that
  holds fewer tokens runs the requests in waves (vLLM queues what does not fit), one that holds more runs
  them together: that difference is the point of a compressed cache in a server.  ``max_num_seqs`` is raised
  to N so the cache space, not the scheduler, is the limit; the engine's "Maximum concurrency" line is kept.
  ``--throughput fit``: each configuration gets as many requests as its own cache holds at once (its KV blocks
  over the blocks of one request), so a larger cache serves more requests in the same run.

* **attention calls** (``--time-attention``): every attention layer call in the engine's process timed by kind (decode
  steps; prefill steps by query and sequence length) for native's CPU attention and ours, with our parts
  (``benchmarks/vllm_attention_timer``): where the time per layer goes, side by side.

Writes ``results.json``, ``table.md`` and each configuration's engine log to ``--out``; the runs kept in
``docs/runs`` hold each configuration's raw output (``<config>.json``, the prompt log-probabilities: megabytes)
gzipped, ``<config>.json.gz`` (``--native-from`` reads either).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
         "/usr/share/common-licenses/MPL-2.0", "argparse"]


def _requests(v: str):
    if v == "fit":
        return v
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--throughput takes a number of requests or 'fit', got {v!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"--throughput must be >= 0, got {n}")
    return n


def _max_seqs(throughput) -> int:
    """The engine's max_num_seqs: the scheduler must never be the limit of a throughput run."""
    return 256 if throughput == "fit" else max(16, throughput)


def _text(name: str) -> str:
    if name == "argparse":
        import argparse as mod

        return Path(mod.__file__).read_text()
    return Path(name).read_text()


def _parse_config(spec: str) -> tuple[str, dict]:
    """'native' or 'preset[:key=value...]' -> (preset or 'native', qjl settings)."""
    name, *opts = spec.split(":")
    extra = {}
    for o in opts:
        k, _, v = o.partition("=")
        extra[k] = int(v) if v.isdigit() else v
    return name, extra


def worker(args) -> None:
    """Runs inside one configuration's process: measures, writes JSON."""
    from vllm import LLM

    from qjl.integrations.vllm.convert import vllm_model_dir

    llm = LLM(model=vllm_model_dir(), enforce_eager=True, dtype=args.dtype, seed=0, max_model_len=args.max_len,
              max_num_batched_tokens=args.chunk, max_num_seqs=_max_seqs(args.throughput), max_logprobs=args.topk,
              enable_prefix_caching=True,  # decode timing re-reads its prompt from the prefix cache
              disable_log_stats=False)  # per-request engine timestamps (first / last token) for decode speed
    tok = llm.get_tokenizer()
    res = {}
    if args.quality:
        res.update(_quality(llm, tok, args))
    if args.speed:
        res["decode_tps"] = _decode_speed(llm, tok, args)
    if args.throughput:
        res["throughput"] = _throughput(llm, tok, args)
    Path(args.json).write_text(json.dumps(res))


def _quality(llm, tok, args) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    res = {}
    kl_texts = []
    for name in TEXTS:
        ids = tok(_text(name))["input_ids"][: args.kl_tokens]
        kl_texts.append(ids)
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=args.topk)
    outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in kl_texts], sp)
    res["prompt_logprobs"] = [[None if d is None else {str(t): lp.logprob for t, lp in d.items()}
                               for d in o.prompt_logprobs] for o in outs]
    res["kl_ids"] = kl_texts
    # greedy agreement
    prompts = []
    for name in TEXTS:
        ids = tok(_text(name))["input_ids"]
        prompts += [ids[1000:1256], ids[2000:2256]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=64, temperature=0))
    res["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
    return res


def _decode_speed(llm, tok, args) -> dict:
    """One stream: after a warm-up that prefills the prompt (kept in the prefix cache), the time of
    1 + N generated tokens minus the time of 1, both re-reading the cached prompt.  Beside it, the prefill
    speed: ctx / wall time of one request of ctx fresh tokens (its first token differs: nothing cached)
    generating one token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    long_ids = []
    for name in TEXTS:
        long_ids += tok(_text(name))["input_ids"]
    out, samples, prefill = {}, {}, {}
    for ctx in (int(c) for c in args.contexts.split(",")):
        first = 99 if long_ids[0] != 99 else 98
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=[first] + long_ids[1:ctx])], SamplingParams(max_tokens=1))
        prefill[str(ctx)] = ctx / (time.perf_counter() - t0)
        p = TokensPrompt(prompt_token_ids=long_ids[:ctx])
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0))
        rates, diffs = [], []
        for _ in range(args.repeats):
            times = {}
            for n in (1, 1 + args.decode_tokens):
                t0 = time.perf_counter()
                o = llm.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
                times[n] = time.perf_counter() - t0
            m = getattr(o, "metrics", None)
            if m is not None and getattr(m, "last_token_ts", 0) > getattr(m, "first_token_ts", 0) > 0:
                rates.append((m.num_generation_tokens - 1) / (m.last_token_ts - m.first_token_ts))
            diffs.append(args.decode_tokens / (times[1 + args.decode_tokens] - times[1]))
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
        out[str(ctx)] = med(rates) if rates else med(diffs)
        samples[str(ctx)] = {"engine_ts": rates, "diff": diffs, "diff_median": med(diffs)}
    out["samples"] = samples
    out["prefill_tps"] = prefill
    return out


def _throughput(llm, tok, args) -> dict:
    """N distinct real-text prompts at once, each generating ``tp_gen`` tokens: generated tokens per second."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = []
    for name in TEXTS:
        ids += tok(_text(name))["input_ids"]
    n, p, g = args.throughput, args.tp_prompt, args.tp_gen
    if n == "fit":  # as many as this configuration's cache holds at once
        cc = llm.llm_engine.vllm_config.cache_config
        n = cc.num_gpu_blocks // -(-(p + g) // cc.block_size)
        if n > _max_seqs("fit"):
            raise SystemExit(f"the cache holds {n} requests, more than --throughput fit allows ({_max_seqs('fit')})")
    n = int(n)
    if len(ids) < p:
        raise SystemExit(f"the texts hold {len(ids)} tokens, fewer than --tp-prompt {p}")
    prompts = []
    for i in range(n):  # its own first token and offset: no two prompts share a cached block
        start = (i * 997) % (len(ids) - p + 1)
        prompts.append(TokensPrompt(prompt_token_ids=[100 + i % 1000] + ids[start:start + p - 1]))
    sp = SamplingParams(max_tokens=g, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": n, "prompt_tokens": p, "generated_tokens": gen, "seconds": wall,
            "generated_tps": gen / wall, "total_tps": (gen + n * p) / wall}


def _kl(native: list, other: list, start: int) -> tuple[float, float, int]:
    """Mean KL(native || other) over native's top-k + rest, positions >= start; mean rest mass."""
    total = rest_mass = 0.0
    n = 0
    for p_text, q_text in zip(native, other):
        for pos in range(start, len(p_text)):
            p, q = p_text[pos], q_text[pos]
            if p is None or q is None:
                continue
            ps = {t: math.exp(lp) for t, lp in p.items()}
            qs = {t: math.exp(q[t]) for t in ps if t in q}
            keep = [t for t in ps if t in qs]
            p_rest = max(1e-12, 1 - sum(ps[t] for t in keep))
            q_rest = max(1e-12, 1 - sum(qs[t] for t in keep))
            total += sum(ps[t] * math.log(ps[t] / qs[t]) for t in keep) + p_rest * math.log(p_rest / q_rest)
            rest_mass += p_rest
            n += 1
    return total / n, rest_mass / n, n


def _ppl_change(ids: list, native: list, other: list, start: int) -> float:
    """Perplexity of the real next tokens (positions >= start) relative to native, in percent (exact: vLLM
    always returns the prompt token's own log-probability)."""
    d = n = 0
    for text, p_text, q_text in zip(ids, native, other):
        for pos in range(start, len(text)):
            t = str(text[pos])
            d += p_text[pos][t] - q_text[pos][t]
            n += 1
    return 100 * (math.exp(d / n) - 1)


def _agreement(native: list, other: list) -> tuple[float, float]:
    same = sum(a == b for x, y in zip(native, other) for a, b in zip(x, y)) / sum(len(x) for x in native)
    prefix = []
    for x, y in zip(native, other):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k)
    return same, sum(prefix) / len(prefix)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="native,tq-k45v3,tq-k3v2")
    ap.add_argument("--kv-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE in GiB")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--kl-tokens", type=int, default=768)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the model's dtype in the engine (bfloat16: every figure before 2026-11-27; float32 where the "
                    "CPU has no bf16 arithmetic: on AVX2-only CPUs torch's bf16 GEMMs run ~55x slower than fp32)")
    ap.add_argument("--contexts", default="1024,8000", help="decode-speed context lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="decode-speed repetitions per context (median)")
    ap.add_argument("--no-speed", dest="speed", action="store_false")
    ap.add_argument("--throughput", type=_requests, default=0,
                    help="N concurrent requests (0: skip), or 'fit': as many as each configuration's cache holds")
    ap.add_argument("--tp-prompt", type=int, default=4096, help="prompt tokens per throughput request")
    ap.add_argument("--tp-gen", type=int, default=128, help="generated tokens per throughput request")
    ap.add_argument("--no-quality", dest="quality", action="store_false", help="skip KL and greedy agreement")
    ap.add_argument("--time-attention", action="store_true",
                    help="time every attention call in the engine (benchmarks/vllm_attention_timer): calls and ms "
                         "per call by kind, in results.json and attention.md")
    ap.add_argument("--out", default=None)
    ap.add_argument("--native-from", default=None, help="reuse a native.json (or .json.gz, or the run directory "
                    "holding it) of an earlier run with the same settings (quality only: native's logprobs and "
                    "tokens are deterministic; timings are never reused)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    out = Path(args.out or f"runs/vllm-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for spec in args.configs.split(","):
        name, extra = _parse_config(spec)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_space), VLLM_CPU_OMP_THREADS_BIND="0-1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        for k in ("QJL_VLLM_PRESET", "QJL_VLLM_CONFIG"):
            env.pop(k, None)
        if name != "native":
            cfg = out / f"{spec.replace(':', '_').replace('=', '')}.qjl.json"
            cfg.write_text(json.dumps({"preset": name, **extra}))
            env["QJL_VLLM_CONFIG"] = str(cfg)
        if args.time_attention:  # every attention call timed in the engine's process (the timer's docstring)
            env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "vllm_attention_timer"),
                                                 env.get("PYTHONPATH", "")])
            env["QJL_ATTENTION_TIMES"] = str(out / f"{spec.replace(':', '_').replace('=', '')}.attention.json")
        js = out / f"{spec.replace(':', '_').replace('=', '')}.json"
        log = out / f"{spec.replace(':', '_').replace('=', '')}.log"
        cmd = [sys.executable, __file__, "--worker", spec, "--json", str(js), "--chunk", str(args.chunk),
               "--kl-tokens", str(args.kl_tokens), "--topk", str(args.topk), "--decode-tokens",
               str(args.decode_tokens), "--max-len", str(args.max_len), "--dtype", args.dtype, "--contexts", args.contexts,
               "--repeats", str(args.repeats), "--throughput", str(args.throughput), "--tp-prompt",
               str(args.tp_prompt), "--tp-gen", str(args.tp_gen)] + ([] if args.speed else ["--no-speed"]) + \
            ([] if args.quality else ["--no-quality"])
        t0, load0 = time.perf_counter(), os.getloadavg()
        with open(log, "w") as fh:
            rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
        if rc:
            raise SystemExit(f"configuration {spec} failed (rc {rc}); see {log}")
        r = json.loads(js.read_text())
        m = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text())
        r["kv_tokens"] = int(m.group(1).replace(",", "")) if m else None
        m = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", log.read_text())
        r["max_concurrency"] = [int(m.group(1).replace(",", "")), float(m.group(2))] if m else None
        r["seconds"] = time.perf_counter() - t0
        if args.time_attention and Path(env["QJL_ATTENTION_TIMES"]).exists():
            r["attention_ms"] = {k: [n, 1e3 * t / n] for k, (n, t) in
                                 sorted(json.loads(Path(env["QJL_ATTENTION_TIMES"]).read_text()).items())}
        r["loadavg_before_after"] = [load0, os.getloadavg()]
        results[spec] = r
        print(f"{spec}: done in {r['seconds']:.0f} s, kv tokens {r['kv_tokens']}", flush=True)
    if "native" not in results and args.native_from:
        src = Path(args.native_from)  # (docs/runs keeps the large per-configuration outputs gzipped)
        if src.is_dir():  # a run's directory: its native output, plain or gzipped
            src = next((f for f in (src / "native.json", src / "native.json.gz") if f.exists()), src / "native.json")
        text = gzip.decompress(src.read_bytes()).decode() if src.suffix == ".gz" else src.read_text()
        results = {"native": {**json.loads(text), "kv_tokens": None, "reused": True},
                   **results}
    base = results.get("native")
    rows = []
    for spec, r in results.items():
        row = {"config": spec, "kv_tokens": r["kv_tokens"], "decode_tps": r.get("decode_tps"),
               "loadavg_before_after": r.get("loadavg_before_after"), "seconds": r.get("seconds"),
               "throughput": r.get("throughput"), "max_concurrency": r.get("max_concurrency"),
               "attention_ms": r.get("attention_ms")}
        if base is not None:
            row["kv_x"] = r["kv_tokens"] / base["kv_tokens"] if r["kv_tokens"] and base["kv_tokens"] else None
        if base is not None and args.quality:
            row["kl"], row["rest_mass"], row["kl_positions"] = _kl(base["prompt_logprobs"], r["prompt_logprobs"],
                                                                   args.chunk)
            row["greedy_same"], row["greedy_prefix"] = _agreement(base["greedy"], r["greedy"])
            row["ppl_change_pct"] = _ppl_change(base["kl_ids"], base["prompt_logprobs"], r["prompt_logprobs"], args.chunk)
        rows.append(row)
    meta = {"argv": sys.argv, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "versions": _versions(), "args": vars(args)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    ctxs = args.contexts.split(",")
    lines = ["| config | KL vs native (lower bound) | ppl vs native | greedy same / prefix (of 64) | KV tokens | x native "
             + "".join(f"| decode tok/s {c} " for c in ctxs) + "".join(f"| prefill tok/s {c} " for c in ctxs) + "|",
             "|---|---|---|---|---|---|" + "---|" * 2 * len(ctxs)]
    for row in rows:
        tps = row.get("decode_tps") or {}
        pre = tps.get("prefill_tps") or {}
        speed = "".join(f" {tps[c]:.1f} |" if c in tps else " - |" for c in ctxs)
        speed += "".join(f" {pre[c]:.0f} |" if c in pre else " - |" for c in ctxs)
        kl = f"{row['kl']:.4f}" if "kl" in row else "-"
        agree = f"{row['greedy_same']:.1%} / {row['greedy_prefix']:.1f}" if "greedy_same" in row else "-"
        ppl = f"{row['ppl_change_pct']:+.2f}%" if "ppl_change_pct" in row else "-"
        kv = f"{row['kv_tokens']:,}" if row["kv_tokens"] else "-"
        lines.append(f"| {row['config']} | {kl} | {ppl} | {agree} | {kv} | {row.get('kv_x') or 1:.2f}x |{speed}")
    if args.throughput:
        lines += ["", f"| config | requests x ({args.tp_prompt} prompt + {args.tp_gen} generated) | seconds | "
                      "generated tok/s | total tok/s | x native (generated tok/s) | requests that fit at once |",
                  "|---|---|---|---|---|---|---|"]
        nat = (base or {}).get("throughput")
        for row in rows:
            t = row.get("throughput")
            if t:
                fit = row["kv_tokens"] // (args.tp_prompt + args.tp_gen) if row["kv_tokens"] else None
                x = f"{t['generated_tps'] / nat['generated_tps']:.2f}x" if nat else "-"
                lines.append(f"| {row['config']} | {t['requests']} | {t['seconds']:.1f} | {t['generated_tps']:.1f} | "
                             f"{t['total_tps']:.1f} | {x} | {fit} |")
    if args.time_attention:  # ms per attention call by kind, configurations side by side
        kinds = sorted({k for row in rows for k in (row.get("attention_ms") or {})
                        if k.split(".")[0] in ("native", "qjl")},
                       key=lambda k: (k.split(".", 1)[1] if k.count(".") else k, k))
        lines += ["", "| attention call (timed in the engine) | config | calls | ms per call |", "|---|---|---|---|"]
        for row in rows:
            for k in kinds:
                if k in (row.get("attention_ms") or {}):
                    n, ms = row["attention_ms"][k]
                    lines.append(f"| {k} | {row['config']} | {n} | {ms:.3f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results in {out}")


def _versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("vllm-cpu", "torch", "transformers")}


if __name__ == "__main__":
    main()
