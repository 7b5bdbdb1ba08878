"""Per-layer cost of one decode step of the qjl vLLM backend, without vLLM (a diagnostic, not a test).

    python benchmarks/vllm_layer_profile.py --threads 1 --context 1024
    python benchmarks/vllm_layer_profile.py --threads 2 --context 1024
    python benchmarks/vllm_layer_profile.py --preset tq-k3v2 --threads 2 --context 3584 --chunk 512
    python benchmarks/vllm_layer_profile.py --preset tq-k3v2 --threads 2 --context 8192 --cycle-layers 30 --flush-mib 64

One layer of the embedded model's shape (3 KV heads, 9 query heads, head_dim 64, ``--block-size``-token pages) in a
page pool
written as the backend writes it (one prefill of ``--context`` tokens), then the pieces of a one-sequence decode
step timed separately (median of ``--repeats`` calls, milliseconds): the step's index plan, key smoothing (where the
preset has it: the mean read back and subtracted), value smoothing (``smooth_values``: the value mean read back,
subtracted, and added to the output; ``smooth_values.first``, not in the total: its first step's attention-weighted
mean over the ``--context`` prompt tokens, once per sequence and layer), the code write (quantization included, one C call), the decode as the backend runs it (``decode``; within it ``decode.kernel``:
the C call through :func:`qjl.kernels.cpu.launch.paged_decode_step` with the step's arguments kept, and
``decode.exact_rows``: the exact slots as rows read in place, as the Triton path takes them), the exact-copy
write, and beside them a dense bf16 ``scaled_dot_product_attention`` over the same context (what one attention
call of a native layer costs, roughly).  With ``--chunk C``: the attention of a C-token prefill chunk over the
``--context`` tokens before it (the backend's ``forward_batch``, its codes written once before; the history
dequantized), ``prefill_chunk`` through vLLM's CPU kernel as the backend runs it (:class:`.prefill.VLLMPrefill`;
the torch path where vLLM's ops do not load) and ``prefill_chunk.sdpa`` through torch's fused float32 SDPA (the
reference), timed alternately.  ``layer.general``: the whole layer as the backend's forward runs it without the
one-call step (``decode="kernel"``: smoothing, store, attention into a bf16 output, value mean), ``layer.one_call``:
the same step through :func:`qjl.integrations.vllm.fused.fused_decode` (the default), each timed as one call.
``--cycle-layers N``: ``decode.kernel`` again, cycling over N copies of the
layer's pages (what an engine's layers see: the other layers' pages between two calls); ``--flush-mib M``: again
after M MiB written between calls (cold caches).  Prints a JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _median_ms(f, repeats: int) -> float:
    f()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tq-k45v3")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=128, help="tokens per page (vLLM's CPU default: 128)")
    ap.add_argument("--chunk", type=int, default=0, help="also time a prefill chunk of this many tokens (0: no)")
    ap.add_argument("--cycle-layers", type=int, default=0,
                    help="also time decode.kernel cycling over this many copies of the layer's pages, as an engine's "
                    "layers follow each other (0: no)")
    ap.add_argument("--flush-mib", type=int, default=0,
                    help="also time decode.kernel after writing this many MiB between calls (caches cold; 0: no)")
    ap.add_argument("--kv-layout", default="LBHNC", choices=["LBHNC", "LHBNC"],
                    help="the pages' physical order: vLLM's LBHNC (block by block) or LHBNC (KV head by KV head)")
    ap.add_argument("--ordered-blocks", action="store_true",
                    help="the sequence's blocks in pool order (as a fresh engine hands them out) instead of shuffled")
    ap.add_argument("--layer", type=int, default=20, help="layer index of 30 (the default preset's keys: 4 bits "
                    "below 15, 5 bits from 15 on)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from qjl.integrations.vllm.decode import decode_function, exact_tokens
    from qjl.integrations.vllm.fused import fused_decode
    from qjl.integrations.vllm.layout import layer_layout
    from qjl.integrations.vllm.paged import page_fields
    from qjl.integrations.vllm.settings import VLLMSettings
    from qjl.integrations.vllm.smoothing import add_value_mean, smooth_keys, smooth_values
    from qjl.integrations.vllm.step import StepPlan, forward_batch
    from qjl.integrations.vllm.writes import write_codes, write_exact
    from qjl.kernels.cpu.launch import paged_decode_step
    from qjl.kernels.paged import role_fields

    hkv, hq, d, bs, n = 3, 9, 64, args.block_size, args.context
    s = VLLMSettings(preset=args.preset)
    lay = layer_layout(s, args.layer, 30, d, bs, torch.bfloat16)
    nblocks = (n + args.chunk) // bs + 2
    if args.kv_layout == "LBHNC":
        pages = torch.zeros(nblocks, hkv, bs, lay.content_bytes // 2, dtype=torch.bfloat16)
    else:  # [H, B, N, C] in memory, viewed [B, H, N, C] as vLLM hands it to the backend
        pages = torch.zeros(hkv, nblocks, bs, lay.content_bytes // 2, dtype=torch.bfloat16).transpose(0, 1)
    fields = page_fields(lay, pages)
    g = torch.Generator().manual_seed(0)
    x = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    table = (torch.arange(nblocks) if args.ordered_blocks else torch.randperm(nblocks, generator=g))[None, :]
    q, k, v = x(n, hq, d), x(n, hkv, d), x(n, hkv, d)
    qsl, lens = torch.tensor([0, n]), torch.tensor([n])
    plan = StepPlan.build(qsl, lens, table, bs, lay.sinks, lay.window)
    smooth = (lambda p, kk: smooth_keys(fields, p, kk)) if lay.smooth_keys else (lambda p, kk: kk)  # noqa: E731
    k = smooth(plan, k)  # as the backend: the mean stored, every key less it
    first_plan, first = plan, (q, k, v)
    vsmooth = ((lambda p, qq_, kk, vv: smooth_values(fields, p, qq_, kk, vv, d ** -0.5)) if lay.smooth_values
               else (lambda p, qq_, kk, vv: (vv, None)))  # noqa: E731
    v, _ = vsmooth(plan, q, k, v)
    write_codes(lay, fields, k, v, None, plan=plan)
    forward_batch(lay, fields, q, k, v, table, qsl, lens, d ** -0.5, plan=plan)  # prefill: exact copies written
    q, k, v = x(1, hq, d), x(1, hkv, d), x(1, hkv, d)
    qsl, lens = torch.tensor([0, 1]), torch.tensor([n + 1])
    plan = StepPlan.build(qsl, lens, table, bs, lay.sinks, lay.window)
    kf, vf = role_fields(fields, "key"), role_fields(fields, "value")  # the backend's FieldMaps (checks kept)
    ex = (fields["exact.key"], fields["exact.value"]) if lay.sinks + lay.window else None
    dec = decode_function(s)
    kw = dict(key_codec=lay.key_codec, value_codec=lay.value_codec, scale=d ** -0.5, num_kv_heads=hkv, exact=ex,
              sinks=lay.sinks, window=lay.window, current=(k, v), rows=plan.decode)
    step = plan.decode.cpu_step(ex, hkv, True)
    qk = (q.float() * d ** -0.5).reshape(1, hkv, hq // hkv, d)
    cur = ((k.unsqueeze(1).transpose(1, 2), v.unsqueeze(1).transpose(1, 2)),)  # [1, H, 1, D]
    kk, qq = x(1, hq, n + 1, d), x(1, hq, 1, d)

    def value_step():  # the decode step's value smoothing: mean read back, subtracted, added to the output
        _, mu = vsmooth(plan, q, k, v)
        if mu is not None:
            add_value_mean(torch.zeros(1, hq, d), mu)

    r = args.repeats
    res = {"preset": args.preset, "layer": args.layer, "context": n, "block_size": bs, "threads": args.threads,
           "kv_layout": args.kv_layout, "ordered_blocks": args.ordered_blocks, "ms": {
        "plan": _median_ms(lambda: StepPlan.build(qsl, lens, table, bs, lay.sinks, lay.window), r),
        "smooth_keys": _median_ms(lambda: smooth(plan, k), r),
        "smooth_values": _median_ms(value_step, r),
        "write_codes": _median_ms(lambda: write_codes(lay, fields, k, v, None, plan=plan), r),
        "decode": _median_ms(lambda: dec(q, kf, vf, plan.decode.block_table, lens - 1, bs, **kw), r),
        "decode.exact_rows": _median_ms(lambda: exact_tokens(ex, plan.decode, hkv, (k, v)), r),
        "decode.kernel": _median_ms(lambda: paged_decode_step(qk, lay.key_codec, kf, lay.value_codec, vf, step,
                                                              exact_fields=ex, segments=cur), r),
        "write_exact": _median_ms(lambda: write_exact(plan, fields, k, v), r),
        "dense_sdpa_bf16": _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, kk), r)}}
    out = torch.empty(1, hq, d, dtype=torch.bfloat16)  # vLLM's output buffer (the model's dtype)

    def general():  # the backend's forward without the one call (decode="kernel")
        kk = smooth(plan, k)
        vv, mu = vsmooth(plan, q, kk, v)
        write_codes(lay, fields, kk, vv, None, plan=plan)
        got = forward_batch(lay, fields, q, kk, vv, table, qsl, lens, d ** -0.5, dec, plan=plan,
                            out=out if mu is None else None)
        if mu is not None:
            out.copy_(add_value_mean(got, mu))

    def one_call():  # the backend's forward (decode="auto"): the step in one C call where it applies
        if fused_decode(lay, fields, plan, q, k, v, d ** -0.5, out) is None:
            raise RuntimeError("the one-call decode step does not serve this layer")

    res["ms"]["layer.general"] = _median_ms(general, r)
    res["ms"]["layer.one_call"] = _median_ms(one_call, r)
    kernel = (lambda kf_, vf_, ex_: paged_decode_step(qk, lay.key_codec, kf_, lay.value_codec, vf_, step,  # noqa: E731
                                                     exact_fields=ex_, segments=cur))
    if args.cycle_layers:  # each copy its own pages and field maps (the arguments kept per map, as in the backend)
        copies = []
        for _ in range(args.cycle_layers):
            fi = page_fields(lay, pages.clone())
            copies.append((role_fields(fi, "key"), role_fields(fi, "value"),
                           (fi["exact.key"], fi["exact.value"]) if ex else None))
        for c in copies:
            kernel(*c)
        ts = []
        for _ in range(max(3, r // 5)):
            for c in copies:
                t0 = time.perf_counter()
                kernel(*c)
                ts.append(time.perf_counter() - t0)
        res["ms"][f"decode.kernel.cycled{args.cycle_layers}"] = sorted(ts)[len(ts) // 2] * 1e3
    if args.flush_mib:
        junk = torch.empty(args.flush_mib * 2**20 // 4)
        ts = []
        for _ in range(r):
            junk.uniform_()  # (not timed)
            t0 = time.perf_counter()
            kernel(kf, vf, ex)
            ts.append(time.perf_counter() - t0)
        res["ms"][f"decode.kernel.flushed{args.flush_mib}"] = sorted(ts)[len(ts) // 2] * 1e3
    if args.chunk:
        c = args.chunk
        q, k, v = x(c, hq, d), x(c, hkv, d), x(c, hkv, d)
        qsl, lens = torch.tensor([0, c]), torch.tensor([n + c])
        plan = StepPlan.build(qsl, lens, table, bs, lay.sinks, lay.window)
        k = smooth(plan, k)
        v, _ = vsmooth(plan, q, k, v)
        write_codes(lay, fields, k, v, None, plan=plan)
        from qjl.integrations.vllm.prefill import VLLMPrefill

        pre = VLLMPrefill()
        paths = {"prefill_chunk": pre, "prefill_chunk.sdpa": None}
        runs = {name: [] for name in paths}
        for _ in range(max(3, r // 5)):  # alternately, so that both see the same machine
            for name, fn in paths.items():
                runs[name].append(_median_ms(lambda: forward_batch(lay, fields, q, k, v, table, qsl, lens, d ** -0.5,
                                                                   plan=plan, prefill=fn), 1))
        for name, ts in runs.items():
            res["ms"][name] = sorted(ts)[len(ts) // 2]
        res["prefill_kernel"] = "vllm" if pre.ran else "torch"
    ms = res["ms"]
    if lay.smooth_values:
        ms["smooth_values.first"] = _median_ms(lambda: vsmooth(first_plan, *first), max(3, r // 5))
    res["ms"]["qjl_layer_total"] = (ms["smooth_keys"] + ms["smooth_values"] + ms["write_codes"] + ms["decode"]
                                    + ms["write_exact"])
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
