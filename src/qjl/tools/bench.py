"""``qjl bench``: decode attention, quantization and end-to-end decoding, side by side.

Everything is timed in one run on this machine, as medians over ``repeats`` after
``warmup`` calls, and reported as ratios against the baselines measured beside it (the decode rows of one
layer and context in interleaved rounds: every method once per round, :func:`_interleaved_ms`).  The run first
measures the machine's memory bandwidth (a large copy, :func:`measure_bandwidth`); every decode row
shows its effective GB/s (bytes the method reads per call / time) and that as a fraction of the
measured bandwidth (the roofline of a bandwidth-bound decode).  Parts (:data:`PARTS`):

1. **decode attention** of one layer (one new token) at several context lengths, for a
   Llama-3-8B layer (32 query heads, 8 KV heads, head_dim 128) and the embedded model's
   layer (9 / 3 / 64): torch SDPA over fp32 and bf16 caches (two ways: ``enable_gqa=True`` as
   transformers calls it, and the GQA group folded into query rows, the faster one here),
   KIVI-style dequantize-then-SDPA (contexts up to 16k: it is two orders slower), and
   :func:`qjl.cache.attention.attend` with the kernel the cache picks (:func:`qjl.kernels.paged_decode`:
   the C kernel on CPU, Triton on CUDA) for the presets ``tq-k3v2`` (<= 3.2 bits), its vector-codebook twin
   ``tqv-k3v2`` (the same bytes; keys in pairs, values in fours over 8 rotations in turn), ``qjl-paper`` and the
   default ``tq-k45v3``, one row per codec pair a preset uses across the embedded model's 30 layers
   (:func:`layer_groups`: ``tq-k45v3 L0-14`` with 4-bit keys, ``L15-29`` with 5-bit); the layer holds the
   context as codes + its exact window, as in generation.
2. **quantization**: compressing the keys and values of an 8k-token prefill of the Llama
   layer, against a plain copy of the same tensors and against the prefill's causal attention.
3. **end to end**: the embedded model with an 8k-token prompt (prefilled in chunks), then
   greedy decoding: tokens/s of the decode and peak RSS (each cache in its own process),
   ``QJLCache`` (default preset) against transformers' ``DynamicCache``.

4. **vllm** (wired by the vLLM integration): throughput at a fixed KV-cache space, native attention
   against the presets; runs ``qjl.integrations.vllm.bench.run_bench(log=...)`` when that module exists.

Output: a table, ``bench.json`` and ``bench.png`` (time against context, one line per method).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


from qjl.integrations.transformers.names import cache_kwargs
__all__ = ["LAYERS", "PARTS", "measure_bandwidth", "run_attention", "run_quantize", "run_e2e", "plot_bench",
           "main_bench"]

LAYERS = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
PRESETS = ("tq-k3v2", "tqv-k3v2", "qjl-paper", "tq-k45v3")
PARTS = ("attention", "quantize", "e2e", "vllm")
KIVI_MAX_CONTEXT = 16384


def measure_bandwidth(mib: int = 512, repeats: int = 7, warmup: int = 2) -> dict:
    """Memory bandwidth of this machine now: ``copy_`` of a ``mib`` MiB float32 buffer on torch's threads
    (STREAM convention: bytes read + bytes written per second), and a read-only ``sum`` of the same buffer."""
    n = mib * 2**20 // 4
    a = torch.ones(n)
    b = torch.empty_like(a)
    copy_ms = _median_ms(lambda: b.copy_(a), repeats, warmup)
    read_ms = _median_ms(lambda: a.sum(), repeats, warmup)
    return {"buffer_mib": mib, "copy_gbps": 2 * n * 4 / copy_ms / 1e6, "read_gbps": n * 4 / read_ms / 1e6,
            "threads": torch.get_num_threads()}


def _check_layers(layers) -> None:
    unknown = [name for name in layers if name not in LAYERS]
    if unknown:
        raise ValueError(f"layer(s) {unknown} unknown; choose from {list(LAYERS)}")


def _median_ms(fn, repeats: int, warmup: int) -> float:
    """Median ms of ``fn`` alone (:func:`_interleaved_ms` with one function and no flush)."""
    return _interleaved_ms({"": fn}, repeats, warmup)[""]


FLUSH_MIB = 128  # the least read before a timed call (more than the last-level caches of the CPUs this ran on)
FLUSH_MAX_MIB = 2048
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")  # index*/size: what Linux reports of cpu0's caches


def largest_cache_mib(root=CPU_CACHES) -> float:
    """The largest CPU cache Linux reports for cpu0 (``index*/size``, e.g. "491520K"), in MiB; 0 where none is."""
    largest = 0.0
    for f in Path(root).glob("index*/size"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(text[-1:].upper())
        try:
            size = float(text[:-1]) * unit if unit else float(text) / 2**20
        except ValueError:
            continue
        largest = max(largest, size)
    return largest


def flush_mib(root=CPU_CACHES) -> int:
    """MiB read before every timed call: twice the largest cache the CPU reports, at least ``FLUSH_MIB``, at most
    ``FLUSH_MAX_MIB`` (a virtual machine may report its host's whole last-level cache: 480 MiB on the Intel Xeon of
    stops 33-36, where a 128 MiB read left a 4k layer's 32 MiB of fp32 K/V partly cached)."""
    return int(min(FLUSH_MAX_MIB, max(FLUSH_MIB, 2 * largest_cache_mib(root))))


def _interleaved_ms(fns: dict, repeats: int, warmup: int, flush=None) -> dict:
    """{name: median ms} of the functions in ``fns``, timed in rounds: each round calls every function once, in
    order, so that every method is timed across the same stretch of the run (a machine whose speed drifts, as
    a shared one does, moves every row alike instead of whichever rows ran during a slow spell).  ``flush``
    (untimed, before every timed call): empties the caches, as in a decode step, where the model's other
    layers run between two calls of a layer and no method finds its cache (codes or K/V) still in cache."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if flush is not None:
                flush()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


NUM_LAYERS = 30  # the embedded model's depth: where a preset's per-layer codecs change


def layer_groups(preset: str, num_layers: int = NUM_LAYERS) -> list:
    """[(first layer, last layer)] of the runs of layers sharing one (key, value) codec pair in ``preset``
    (``tq-k45v3``: 4-bit keys in layers 0-14, 5-bit from 15 on); each is timed as its own row."""
    from qjl.cache.config import QJLConfig

    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    cfg, groups = QJLConfig.preset(preset), []
    for i in range(num_layers):
        if groups and cfg.specs(i, num_layers) == cfg.specs(groups[-1][0], num_layers):
            groups[-1][1] = i
        else:
            groups.append([i, i])
    return [tuple(g) for g in groups]


def _layer(preset: str, k: torch.Tensor, v: torch.Tensor, kernel: str = "auto", layer_idx: int = 0):
    """A LayerStore of layer ``layer_idx`` holding k, v [1, H_kv, L, D] as generation would leave it (codes +
    exact window)."""
    from qjl.cache.config import QJLConfig
    from qjl.cache.storage import LayerStore

    store = LayerStore(layer_idx, QJLConfig.preset(preset, kernel=kernel), num_layers=NUM_LAYERS)
    store.append(k, v)
    store.flush()
    return store


def _kivi(k: torch.Tensor, v: torch.Tensor):
    from qjl.codecs.kivi import KIVIKeys
    from qjl.codecs.tokenwise import TokenwiseQuantizer

    d = k.shape[-1]
    kc, vc = KIVIKeys(d, 2, group_size=32), TokenwiseQuantizer(d, 2, group_size=32)
    n = k.shape[-2] // 32 * 32
    return kc, kc.quantize(k[..., :n, :]), vc, vc.quantize(v[..., :n, :])


def _impls(backend: str) -> list:
    """[(row label, CPU kernel impl or None)]: on CPU the default path ("c-amx" or "c-int" where the CPU has it)
    and, beside it, the integer path on vpdpbusd ("c-int", where the default is "c-amx") and the fp32 path "c"."""
    if backend != "cpu":
        return [(backend, None)]
    from qjl.kernels.cpu import launch

    first = launch.default_impl()
    beside = {"c-amx": ("c-int", "c"), "c": ()}.get(first, ("c",))
    return [(f"cpu {impl}", impl) for impl in (first, *beside)]


def _with_impl(impl, fn, *args):
    """fn(*args) with the CPU kernel's impl set through ``QJL_CPU_IMPL`` (restored after)."""
    if impl is None:
        return fn(*args)
    old = os.environ.get("QJL_CPU_IMPL")
    os.environ["QJL_CPU_IMPL"] = impl
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ["QJL_CPU_IMPL"]
        else:
            os.environ["QJL_CPU_IMPL"] = old


def run_attention(contexts=(1024, 4096, 16384, 65536), layers=("llama3-8b", "smollm2-135m"), presets=PRESETS,
                  repeats: int = 7, warmup: int = 2, kernel: str = "auto", progress=None,
                  bandwidth_gbps: float | None = None, flush_caches: bool = True) -> list:
    """Rows {layer, context, method, ms, bytes, gbps, roofline, x_vs_sdpa_fp32_gqa, x_vs_sdpa_fp32_rows}.

    bytes: what the method reads per call (fp32/bf16 K and V; the codes, norms, sinks and window held);
    gbps = bytes / time; roofline = gbps / ``bandwidth_gbps`` (None when no bandwidth is given).
    The methods of one layer and context are timed in interleaved rounds (:func:`_interleaved_ms`), each call
    after reading a :func:`flush_mib` buffer (``flush_caches``; untimed) so that none finds its data in cache."""
    _check_layers(layers)
    if not contexts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in contexts):
        raise ValueError(f"contexts must be positive ints, got {contexts!r}")
    if not isinstance(flush_caches, bool):
        raise TypeError(f"flush_caches must be a bool, got {type(flush_caches).__name__} {flush_caches!r}")
    rows = []
    # float32, flush_mib() MiB, read before every call: it evicts the method's data without leaving dirty lines
    # whose write-back would load the next timed call
    flush = torch.zeros(flush_mib() << 18) if flush_caches else None
    for name in layers:
        hq, hkv, d = LAYERS[name]
        g = hq // hkv
        for n in contexts:
            gen = torch.Generator().manual_seed(n)
            k = torch.randn(1, hkv, n, d, generator=gen)
            v = torch.randn(1, hkv, n, d, generator=gen)
            q = torch.randn(1, hq, 1, d, generator=gen)
            scale = d ** -0.5
            kb, vb = k.bfloat16(), v.bfloat16()
            qb = q.bfloat16()
            timed = {
                "sdpa-fp32 (enable_gqa)": (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                           2 * k.numel() * 4),
                "sdpa-fp32 (rows)": (lambda: F.scaled_dot_product_attention(q.view(1, hkv, g, d), k, v), 2 * k.numel() * 4),
                "sdpa-bf16 (rows)": (lambda: F.scaled_dot_product_attention(qb.view(1, hkv, g, d), kb, vb),
                                     2 * k.numel() * 2),
            }
            kcodes = vcodes = None
            if n <= KIVI_MAX_CONTEXT:
                kc, kcodes, vc, vcodes = _kivi(k, v)

                def kivi_sdpa():
                    kk, vv = kc.dequantize(kcodes), vc.dequantize(vcodes)
                    return F.scaled_dot_product_attention(q.view(1, hkv, g, d), kk, vv)

                timed["kivi-k2v2 dequant+sdpa"] = (kivi_sdpa, kcodes.nbytes() + vcodes.nbytes())
            from qjl.cache.attention import attend

            for preset in presets:
                groups = layer_groups(preset)
                for first, last in groups:  # one row per codec pair of the preset's layers
                    store = _layer(preset, k, v, kernel, first)
                    held = sum(store.nbytes().values())
                    part = f" L{first}-{last}" if len(groups) > 1 else ""
                    for label, impl in _impls(store.backend):  # the CPU kernel: its integer and fp32 paths
                        timed[f"{preset}{part} [{label}]"] = (
                            lambda store=store, impl=impl: _with_impl(impl, attend, store, q, None, scale), held)
            medians = _interleaved_ms({method: fn for method, (fn, _) in timed.items()}, repeats, warmup,
                                      flush=flush.sum if flush is not None else None)
            results = {}
            for method, (_, nbytes) in timed.items():
                results[method] = (medians[method], nbytes)
                if progress:
                    progress(f"{name} {n}: {method} {medians[method]:.2f} ms")
            base_gqa = results["sdpa-fp32 (enable_gqa)"][0]
            base_rows = results["sdpa-fp32 (rows)"][0]
            for method, (ms, nbytes) in results.items():
                gbps = nbytes / ms / 1e6
                rows.append({"layer": name, "context": n, "method": method, "ms": ms, "bytes": nbytes,
                             "gbps": gbps, "roofline": gbps / bandwidth_gbps if bandwidth_gbps else None,
                             "x_vs_sdpa_fp32_gqa": base_gqa / ms, "x_vs_sdpa_fp32_rows": base_rows / ms})
            del k, v, kb, vb, timed, kcodes, vcodes
    return rows


def run_quantize(tokens: int = 8192, layer: str = "llama3-8b", preset: str = "tq-k3v2", repeats: int = 3,
                 warmup: int = 1, kernel: str = "auto") -> dict:
    """Compressing one layer's prefill (keys and values) vs a plain copy vs the prefill's attention."""
    from qjl.cache.config import QJLConfig
    from qjl.cache.storage import LayerStore

    _check_layers((layer,))
    hq, hkv, d = LAYERS[layer]
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, hkv, tokens, d, generator=gen), torch.randn(1, hkv, tokens, d, generator=gen)
    q = torch.randn(1, hq, tokens, d, generator=gen)
    cache = LayerStore(0, QJLConfig.preset(preset, kernel=kernel), num_layers=30)
    cache.initialize(k, v)

    def quantize():
        return cache.encode(k, v)

    quant = _median_ms(quantize, repeats, warmup)
    copy = _median_ms(lambda: (k.clone(), v.clone()), repeats, warmup)
    attn = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), repeats, warmup)
    mb = 2 * k.numel() * 4 / 1e6
    return {"layer": layer, "tokens": tokens, "preset": preset, "backend": cache.backend, "quantize_ms": quant,
            "copy_ms": copy, "prefill_attention_ms": attn, "quantize_over_attention": quant / attn,
            "quantize_over_copy": quant / copy, "quantize_mb_per_s": mb / quant * 1e3}


E2E_TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL-2",
             "/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/MPL-2.0")


def long_text_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """n_tokens of real English: the license texts every Debian machine has, one after another."""
    ids = []
    for path in E2E_TEXTS:
        if Path(path).exists():
            ids.append(tokenizer(Path(path).read_text(encoding="utf-8"), return_tensors="pt").input_ids[0])
        if sum(i.numel() for i in ids) >= n_tokens:
            return torch.cat(ids)[:n_tokens]
    raise ValueError(f"the texts {E2E_TEXTS} hold fewer than {n_tokens} tokens")


def _e2e_child(method: str, context: int, new_tokens: int, chunk: int, queue) -> None:
    try:
        queue.put(_e2e_run(method, context, new_tokens, chunk))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        queue.put({"method": method, "error": f"{type(exc).__name__}: {exc}"})


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _e2e_run(method: str, context: int, new_tokens: int, chunk: int) -> dict:
    from qjl.integrations.transformers.cache import QJLCache
    from qjl.tools.models import load_model

    torch.set_grad_enabled(False)
    model, tok = load_model()
    import qjl

    qjl.patch_attention(model)
    ids = long_text_ids(tok, context)[None]
    if method == "dynamic":
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    else:
        cache = QJLCache(model)
    t0 = time.perf_counter()
    out = None
    for s in range(0, context, chunk):
        out = model(ids[:, s:s + chunk], **cache_kwargs(cache), use_cache=True)
    prefill = time.perf_counter() - t0
    nxt = out.logits[:, -1:].argmax(-1)
    steps = []
    generated = []
    for _ in range(new_tokens):
        t = time.perf_counter()
        out = model(nxt, **cache_kwargs(cache), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        steps.append(time.perf_counter() - t)
        generated.append(int(nxt))
    warm = steps[2:] if len(steps) > 4 else steps
    if method == "dynamic":
        held = sum(t.numel() * t.element_size() for lay in cache.layers for t in (lay.keys, lay.values))
    else:
        held = cache.nbytes()
    return {"method": method, "context": context, "prefill_s": prefill, "decode_tok_s": 1 / statistics.median(warm),
            "decode_ms_median": statistics.median(warm) * 1e3, "new_tokens": new_tokens,
            "cache_bytes": held, "peak_rss_mb": _peak_rss_mb(),
            "tokens": generated}


def run_e2e(context: int = 8192, new_tokens: int = 24, chunk: int = 512, methods=("dynamic", "qjl")) -> list:
    """End-to-end decode on the embedded model, each method in a fresh process (its own peak RSS)."""
    import multiprocessing as mp

    unknown = set(methods) - {"dynamic", "qjl"}
    if unknown:
        raise ValueError(f"methods must be 'dynamic' and/or 'qjl', got {sorted(unknown)}")
    ctx = mp.get_context("spawn")
    rows = []
    for method in methods:
        queue = ctx.Queue()
        proc = ctx.Process(target=_e2e_child, args=(method, context, new_tokens, chunk, queue))
        proc.start()
        row = None
        while row is None:
            try:
                row = queue.get(timeout=5)
            except Exception:  # noqa: BLE001 - queue.Empty: is the child still alive?
                if not proc.is_alive():
                    raise RuntimeError(f"end-to-end run of {method} died (exit code {proc.exitcode})") from None
        proc.join()
        if "error" in row:
            raise RuntimeError(f"end-to-end run of {method} failed: {row['error']}")
        rows.append(row)
    return rows


def plot_bench(rows: list, path) -> None:
    """Decode attention time against context, one line per method, one panel per layer."""
    from qjl.tools.report import save_figure, two_panels

    fig, axes = two_panels()
    for ax, layer in zip(axes, LAYERS):
        sel = [r for r in rows if r["layer"] == layer]
        for method in dict.fromkeys(r["method"] for r in sel):
            pts = sorted((r["context"], r["ms"]) for r in sel if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        hq, hkv, d = LAYERS[layer]
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode attention, ms (median)",
               title=f"{layer}: {hq} q / {hkv} kv heads, d={d}")
    save_figure(fig, axes, path)


def _vllm_part(log):
    """The vLLM throughput section: run by the vLLM integration's bench module where it exists."""
    try:
        from qjl.integrations.vllm import bench as vllm_bench
    except ImportError as exc:
        log(f"vllm: skipped ({type(exc).__name__}: {exc})")
        return None
    return vllm_bench.run_bench(log=log)


def main_bench(out_dir: Path, contexts, repeats: int, warmup: int, e2e_context: int, e2e_tokens: int,
               parts=("attention", "quantize", "e2e"), kernel: str = "auto", log=print) -> dict:
    from qjl.tools.report import environment, format_table, write_json

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"parts must be among {PARTS}, got {sorted(unknown)}")
    env = environment()
    import transformers

    from qjl.kernels.cpu import launch as cpu_kernels

    env["transformers"] = transformers.__version__
    env["torch_threads"] = torch.get_num_threads()
    env["device"] = "cpu"
    env["cpu_kernel"] = f"{cpu_kernels.implementation()} ({cpu_kernels.simd_path()})"
    env["flush_mib"] = flush_mib()  # read before every timed attention call
    log("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    result = {"environment": env}
    if "attention" in parts:
        bw = measure_bandwidth(repeats=repeats, warmup=warmup)
        result["bandwidth"] = bw
        log(f"memory bandwidth: copy {bw['copy_gbps']:.1f} GB/s (read + write), read {bw['read_gbps']:.1f} GB/s "
            f"({bw['buffer_mib']} MiB, {bw['threads']} threads)")
        rows = run_attention(contexts, repeats=repeats, warmup=warmup, kernel=kernel, progress=log,
                             bandwidth_gbps=bw["copy_gbps"])
        result["attention"] = rows
        table = [[r["layer"], r["context"], r["method"], f"{r['ms']:.3f}", f"{r['bytes'] / 2**20:.1f}",
                  f"{r['gbps']:.1f}", f"{100 * r['roofline']:.0f}%", f"{r['x_vs_sdpa_fp32_gqa']:.2f}",
                  f"{r['x_vs_sdpa_fp32_rows']:.2f}"] for r in rows]
        log(format_table(["layer", "context", "method", "ms", "MiB read", "GB/s", "of copy BW", "x sdpa-gqa",
                          "x sdpa-rows"], table))
        plot_bench(rows, out_dir / "bench.png")
    if "quantize" in parts:
        qr = run_quantize(repeats=repeats, warmup=warmup, kernel=kernel)
        result["quantize"] = qr
        log(f"quantize {qr['tokens']} tokens of {qr['layer']} ({qr['preset']}, {qr['backend']}): {qr['quantize_ms']:.1f} ms; "
            f"copy {qr['copy_ms']:.1f} ms; causal prefill attention {qr['prefill_attention_ms']:.1f} ms; "
            f"quantize / attention = {qr['quantize_over_attention']:.3f}")
    if "e2e" in parts:
        er = run_e2e(e2e_context, e2e_tokens)
        result["e2e"] = er
        base = next(r for r in er if r["method"] == "dynamic")
        for r in er:
            r["x_tok_s_vs_dynamic"] = r["decode_tok_s"] / base["decode_tok_s"]
        log(format_table(["cache", "context", "decode tok/s", "x dynamic", "cache MiB", "peak RSS MiB", "prefill s"],
                         [[r["method"], r["context"], f"{r['decode_tok_s']:.2f}", f"{r['x_tok_s_vs_dynamic']:.2f}",
                           f"{r['cache_bytes'] / 2**20:.1f}", f"{r['peak_rss_mb']:.0f}", f"{r['prefill_s']:.1f}"]
                          for r in er]))
        same = sum(a == b for a, b in zip(er[0]["tokens"], er[-1]["tokens"]))
        log(f"greedy tokens identical to DynamicCache's: {same}/{len(er[0]['tokens'])}")
    if "vllm" in parts:
        result["vllm"] = _vllm_part(log)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "bench.json", result)
    log(f"wrote {out_dir / 'bench.json'}" + (f" and {out_dir / 'bench.png'}" if "attention" in parts else ""))
    return result
