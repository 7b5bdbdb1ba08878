"""The Triton kernels and the transformers cache on a CUDA GPU, against torch SDPA in the same run.  A measurement,
not a test (the tests run natively with ``TRITON_INTERPRET=0 pytest tests/kernels/test_triton*.py``).

    python benchmarks/gpu_kernels.py [--contexts 4096 16384 65536 131072] [--parts bw attention quantize e2e]
                                     [--presets P ...] [--out DIR]

Parts (each independent; a failing part is reported and the others still run):

* ``bw``: device-to-device copy of a 1 GiB buffer, bytes read + written per second (the roofline).
* ``attention``: one Llama-3-8B layer (32 query / 8 KV heads, d = 128), one decode query, batch 1 and 8:
  torch SDPA over bf16 K/V (``enable_gqa``, and the KV-head "rows" form that reads K/V once) vs a
  ``LayerStore`` of each preset attended by :func:`qjl.cache.attention.attend` (the Triton paged kernel);
  the store's output is compared with the same store attended by the plain-torch reference.
* ``quantize``: compressing a layer's K/V (``LayerStore.encode``, Triton quantize kernel) vs a bf16 copy and
  vs the prefill's flash attention.
* ``profile``: torch.profiler over 20 decode attention calls (tq-k3v2, 16k tokens): where the time goes.
* ``e2e``: a randomly initialised Llama (Llama-3-8B attention, ``--e2e-layers`` layers) in bf16 through
  ``model(...)`` decode steps, ``QJLCache`` vs ``DynamicCache``: tokens/s and cache bytes held.

Times are medians of ``triton.testing.do_bench`` (CUDA events, warm-up first); inputs are random, never zeros.
Writes ``<out>/gpu_kernels.json`` and prints a table.
"""
import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F


from qjl.integrations.transformers.names import cache_kwargs
HQ, HKV, D = 32, 8, 128
PRESETS = ["tq-k3v2", "tq-k45v3", "tqv-k3v2", "qjl-paper"]  # --presets replaces it


def _bench(fn, device) -> float:
    """Median milliseconds of fn()."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def part_bw(device, log) -> dict:
    n = (2**28 if device.type == "cuda" else 2**22)
    a = torch.randn(n, device=device)
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a), device)
    gbps = 2 * n * 4 / ms / 1e6
    log(f"copy {n * 4 / 2**20:.0f} MiB: {ms:.3f} ms, {gbps:.0f} GB/s (read + write)")
    return {"copy_gbps": gbps, "buffer_mib": n * 4 / 2**20}


def _store(preset, k, v, kernel):
    from qjl.cache.config import QJLConfig
    from qjl.cache.storage import LayerStore

    store = LayerStore(0, QJLConfig.preset(preset, kernel=kernel), num_layers=32)
    store.append(k, v)
    store.flush()
    return store


def part_attention(device, contexts, batches, bw, log) -> list:
    from qjl.cache.attention import attend

    rows = []
    g, scale = HQ // HKV, D ** -0.5
    for b in batches:
        for n in contexts:
            if b * n > 8 * 65536 and device.type == "cuda" or b * n > 4096 and device.type == "cpu":
                continue
            gen = torch.Generator(device=device).manual_seed(n + b)
            k = torch.randn(b, HKV, n, D, device=device, generator=gen, dtype=torch.bfloat16)
            v = torch.randn(b, HKV, n, D, device=device, generator=gen, dtype=torch.bfloat16)
            q = torch.randn(b, HQ, 1, D, device=device, generator=gen, dtype=torch.bfloat16)
            exact = F.scaled_dot_product_attention(q.float().view(b, HKV, g, D), k.float(), v.float(), scale=scale)
            timed = {
                "sdpa-bf16 (enable_gqa)": (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 4 * k.numel()),
                "sdpa-bf16 (rows)": (lambda: F.scaled_dot_product_attention(q.view(b, HKV, g, D), k, v), 4 * k.numel()),
            }
            errors = {}
            for preset in PRESETS:
                try:
                    store = _store(preset, k, v, "auto")
                    ref_store = _store(preset, k, v, "torch")
                    got = attend(store, q, None, scale).float().view(b, HKV, g, D)
                    ref = attend(ref_store, q, None, scale).float().view(b, HKV, g, D)
                except Exception as exc:  # noqa: BLE001 - reported, the other presets still run
                    log(f"b={b} n={n} {preset} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                del ref_store
                errors[preset] = {
                    "kernel_vs_reference": float((got - ref).norm() / ref.norm()),
                    "vs_exact_attention": float((got - exact).norm() / exact.norm()),
                    "finite": bool(torch.isfinite(got).all()),
                }
                held = sum(store.nbytes().values())
                timed[f"{preset} [{store.backend}]"] = (lambda store=store: attend(store, q, None, scale), held)
            res = {}
            for method, (fn, nbytes) in timed.items():
                try:
                    res[method] = (_bench(fn, device), nbytes)
                except Exception as exc:  # noqa: BLE001
                    log(f"b={b} n={n} {method} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            base = res["sdpa-bf16 (enable_gqa)"][0]
            rows_ms = res["sdpa-bf16 (rows)"][0]
            for method, (ms, nbytes) in res.items():
                preset = method.split(" ")[0]
                row = {"batch": b, "context": n, "method": method, "ms": ms, "bytes": nbytes,
                       "gbps": nbytes / ms / 1e6, "roofline": nbytes / ms / 1e6 / bw if bw else None,
                       "x_vs_sdpa_gqa": base / ms, "x_vs_sdpa_rows": rows_ms / ms, **errors.get(preset, {})}
                rows.append(row)
                log(f"b={b} n={n:>6} {method:<26} {ms:8.3f} ms  {row['gbps']:7.0f} GB/s  "
                    f"x{row['x_vs_sdpa_rows']:.2f} vs rows  {errors.get(preset, '')}")
            del k, v, q, timed, exact
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def part_quantize(device, tokens_list, log) -> list:
    rows = []
    for n in tokens_list:
        gen = torch.Generator(device=device).manual_seed(n)
        k = torch.randn(1, HKV, n, D, device=device, generator=gen, dtype=torch.bfloat16)
        v = torch.randn(1, HKV, n, D, device=device, generator=gen, dtype=torch.bfloat16)
        q = torch.randn(1, HQ, n, D, device=device, generator=gen, dtype=torch.bfloat16)
        copy_ms = _bench(lambda: (k.clone(), v.clone()), device)
        attn_ms = _bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), device)
        for preset in PRESETS:
            for kernel in ("auto", "torch"):
                store = _store(preset, k[..., :64, :], v[..., :64, :], kernel)
                ms = _bench(lambda: store.encode(k, v), device)
                row = {"tokens": n, "preset": preset, "backend": store.backend, "encode_ms": ms, "copy_ms": copy_ms,
                       "prefill_attention_ms": attn_ms, "encode_over_attention": ms / attn_ms,
                       "tokens_per_s": n / ms * 1e3}
                rows.append(row)
                log(f"quantize n={n:>6} {preset:<10} [{store.backend:<6}] {ms:8.3f} ms  copy {copy_ms:.3f} ms  "
                    f"prefill attention {attn_ms:.3f} ms  ({ms / attn_ms:.2f}x of it)")
        del k, v, q
    return rows


def part_sweep(device, log) -> list:
    """The Triton decode (both launches) over block_n x num_warps x splits x the decode kernel's dot precision,
    tq-k3v2, to pick defaults; ``err``: against the default configuration's output."""
    from qjl.kernels.triton import launch as tk

    rows = []
    shapes = ((1, 4096), (1, 16384), (1, 131072), (8, 65536)) if device.type == "cuda" else ((1, 256),)
    for b, n in shapes:
        gen = torch.Generator(device=device).manual_seed(n)
        k, v = (torch.randn(b, HKV, n, D, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(b, HKV, HQ // HKV, D, device=device, generator=gen) * D ** -0.5
        preset = "tq-k3v2"
        st = _store(preset, k, v, "auto")
        kf, vf, bs = st.kernel_fields()
        bt = torch.arange(b, dtype=torch.int32, device=device)[:, None]
        s0 = torch.zeros(b, dtype=torch.int32, device=device)
        s1 = torch.full((b,), st.n_codes, dtype=torch.int32, device=device)
        auto = tk._splits(device, b * HKV, st.n_codes, 16)
        ref = tk.paged_decode(q, st.key_codec, kf, st.value_codec, vf, bt, bs, s0, s1, precision="ieee")
        for prec in ("ieee", "tf32", "fma"):
            for bn in (16,):
                for nw in (4, 8):
                    for sp in sorted({max(1, auto // 4), auto, 2 * auto}):
                        def call():
                            return tk.paged_decode(q, st.key_codec, kf, st.value_codec, vf, bt, bs, s0, s1,
                                                   block_n=bn, splits=sp, num_warps=nw, precision=prec)
                        try:
                            out = call()
                            err = float((out - ref).abs().max() / ref.abs().max())
                            ms = _bench(call, device)
                        except Exception as exc:  # noqa: BLE001
                            log(f"sweep b={b} n={n} {preset} {prec} bn={bn} nw={nw} sp={sp}: {type(exc).__name__}")
                            continue
                        rows.append({"batch": b, "context": n, "preset": preset, "block_n": bn, "num_warps": nw,
                                     "splits": sp, "precision": prec, "ms": ms, "err": err})
        mine = [r for r in rows if r["batch"] == b and r["context"] == n]
        for r in sorted(mine, key=lambda r: r["ms"])[:5]:
            log(f"sweep b={b} n={n} {preset}: {r['precision']} bn={r['block_n']} nw={r['num_warps']} "
                f"sp={r['splits']} {r['ms']:.3f} ms err {r['err']:.1e}")
        for prec in ("fma", "ieee"):  # the default (auto: fma for these 4 rows) and the tl.dot form
            base = [r for r in mine if r["block_n"] == 16 and r["num_warps"] == 4 and r["splits"] == auto
                    and r["precision"] == prec]
            if base:
                log(f"sweep b={b} n={n} {preset}: {prec} bn=16 nw=4 default splits {auto}: {base[0]['ms']:.3f} ms")
        del k, v
    return rows


def part_profile(device, log) -> dict:
    """Where one decode attention call spends its time: torch.profiler over 20 calls (tq-k3v2, 16k, batch 1)."""
    from torch.profiler import ProfilerActivity, profile

    from qjl.cache.attention import attend

    gen = torch.Generator(device=device).manual_seed(0)
    k, v = (torch.randn(1, HKV, 16384, D, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(1, HQ, 1, D, device=device, generator=gen, dtype=torch.bfloat16)
    store = _store("tq-k3v2", k, v, "auto")
    for _ in range(3):
        attend(store, q, None, D ** -0.5)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(20):
            attend(store, q, None, D ** -0.5)
        if device.type == "cuda":
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    log(table)
    if device.type == "cuda":
        log(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    return {"table": table}


def _generate(model, cache, ids, context: int, new_tokens: int, device) -> tuple:
    """Prefill ``ids`` in 4k chunks, then ``new_tokens`` greedy steps -> (prefill s, per-step s, next id, tokens)."""
    t0 = time.perf_counter()
    out = None
    for s in range(0, context, 4096):
        out = model(ids[:, s:s + 4096], **cache_kwargs(cache), use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    prefill = time.perf_counter() - t0
    steps, toks = [], []
    for _ in range(new_tokens):
        t = time.perf_counter()
        out = model(nxt, **cache_kwargs(cache), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        toks.append(int(nxt))  # .item() synchronizes
        steps.append(time.perf_counter() - t)
    return prefill, steps, nxt, toks


def part_e2e(device, context, new_tokens, layers, log) -> list:
    import qjl
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    small = device.type == "cpu"
    cfg = LlamaConfig(vocab_size=32000, hidden_size=256 if small else 4096, intermediate_size=512 if small else 14336,
                      num_hidden_layers=layers, num_attention_heads=HQ, num_key_value_heads=HKV,
                      head_dim=8 if small else D, max_position_embeddings=max(context * 2, 4096),
                      rope_theta=500000.0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    torch.set_grad_enabled(False)
    ids = torch.randint(5, 32000, (1, context), generator=torch.Generator().manual_seed(1)).to(device)
    rows = []
    methods = ("dynamic-sdpa", "dynamic-flash", "dynamic", "qjl-tq-k45v3", "qjl-tq-k3v2")
    for method in methods if device.type == "cuda" else [m for m in methods if m != "dynamic-flash"]:
        # dynamic-flash: as dynamic-sdpa with SDPA kept off cuDNN's kernel (torch may pick it, and it plans anew for
        # every new key length: milliseconds of CPU per layer and step): flash, memory-efficient or math
        flash = contextlib.nullcontext()
        if method == "dynamic-flash":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            flash = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
        if method.startswith("dynamic-"):  # the model as transformers ships it, before patch_attention
            model.set_attn_implementation("sdpa")
        elif method == "dynamic":  # a plain cache through the patched model (qjl's attention hands it to SDPA)
            qjl.patch_attention(model)
        if method.startswith("dynamic"):
            cache = DynamicCache(config=model.config)
        else:
            cache = qjl.QJLCache(model, qjl.QJLConfig.preset(method[4:]))
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with flash:
            prefill, steps, nxt, toks = _generate(model, cache, ids, context, new_tokens, device)
        warm = statistics.median(steps[3:])
        if method in ("dynamic", "qjl-tq-k3v2") and device.type == "cuda":  # where one decode step's time goes
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                out = model(nxt, **cache_kwargs(cache), use_cache=True)
                torch.cuda.synchronize()
            for key in ("self_cpu_time_total", "self_cuda_time_total"):
                log(f"e2e {method} one step by {key}:\n" + prof.key_averages().table(
                    sort_by=key, row_limit=8, max_name_column_width=50))
        if method.startswith("dynamic"):
            held = sum(t.numel() * t.element_size() for lay in cache.layers for t in (lay.keys, lay.values))
        else:
            held = cache.nbytes()
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
        row = {"method": method, "context": context, "layers": layers, "prefill_s": prefill, "decode_ms": warm * 1e3,
               "tokens_per_s": 1 / warm, "cache_mib": held / 2**20, "peak_allocated_mib": peak, "tokens": toks}
        rows.append(row)
        log(f"e2e {method:<14} {context} tokens, {layers} layers: decode {warm * 1e3:.2f} ms/token "
            f"({1 / warm:.1f} tok/s), prefill {prefill:.2f} s, cache {held / 2**20:.1f} MiB, peak {peak} MiB")
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    by = {r["method"]: r["tokens"] for r in rows}
    same = sum(a == b for a, b in zip(by["dynamic-sdpa"], by["qjl-tq-k45v3"]))
    log(f"e2e: {same}/{new_tokens} greedy tokens of the default equal DynamicCache's (random weights)")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--quantize-tokens", type=int, nargs="+", default=[8192, 65536])
    p.add_argument("--parts", nargs="+", default=["bw", "attention", "quantize", "e2e"])
    p.add_argument("--e2e-context", type=int, default=32768)
    p.add_argument("--e2e-layers", type=int, default=8)
    p.add_argument("--e2e-tokens", type=int, default=24)
    p.add_argument("--presets", nargs="+", default=PRESETS, help="fixed presets timed by attention and quantize")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="runs")
    args = p.parse_args(argv)
    PRESETS[:] = args.presets
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    env = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if device.type == "cuda":
        import triton

        env.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__,
                   sms=torch.cuda.get_device_properties(0).multi_processor_count)
    log(f"environment: {env}")
    result = {"env": env, "args": vars(args)}
    bw = None
    for part in args.parts:
        t = time.perf_counter()
        try:
            if part == "bw":
                result["bw"] = part_bw(device, log)
                bw = result["bw"]["copy_gbps"]
            elif part == "attention":
                result["attention"] = part_attention(device, args.contexts, args.batches, bw, log)
            elif part == "quantize":
                result["quantize"] = part_quantize(device, args.quantize_tokens, log)
            elif part == "sweep":
                result["sweep"] = part_sweep(device, log)
            elif part == "profile":
                result["profile"] = part_profile(device, log)
            elif part == "e2e":
                result["e2e"] = part_e2e(device, args.e2e_context, args.e2e_tokens, args.e2e_layers, log)
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception:  # noqa: BLE001 - a measurement script: report and go on to the next part
            tb = traceback.format_exc()
            log(f"part {part} FAILED:\n{tb}")
            result[f"{part}_error"] = tb
        log(f"part {part}: {time.perf_counter() - t:.1f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_kernels.log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
