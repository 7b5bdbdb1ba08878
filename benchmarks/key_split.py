"""Keys split by channel importance into two TurboQuant groups, against one group at the same bits (a measurement,
not a test; docs/cache.md, "Keys split by channel importance").

One full-precision prefill of ``--tokens`` tokens of a text through the embedded model; per layer, the prompt's keys
and values and its last 64 queries (``recording_queries``).  Keys are smoothed (the plain channel mean of the coded
tokens, as the cache does) and coded between 4 sinks and a 120-token window; values stay exact, so the error is the
keys' alone.  The first 32 of the recorded queries choose the channels (importance ``E[k_i^2] E[q_i^2]`` per KV
head, or summed over the layer's heads, or ``E[k_i^2]`` alone); the other 32 (held out) measure the attention
output's squared error relative to its energy, summed over the 30 layers.  A split ``m: b1+b2`` codes the ``m``
most important channels with a ``b1``-bit TurboQuant (its own rotation and norm) and the rest with ``b2`` bits;
bits per value count both norms (fp16: 16 bits, fp8: 8 per token and group) and leave out the channel sets (64
bits per KV head and layer).

    python benchmarks/key_split.py --text licenses
"""

from __future__ import annotations

import torch

# name: (bits per value, None for one group of `bits` | (m, b1, b2), norm dtype, channel choice)
CONFIGS = {
    "k3 fp16": (3.25, 3, "fp16", None),
    "k3 fp8": (3.125, 3, "fp8", None),
    "k4 fp16": (4.25, 4, "fp16", None),
    "split32 4+2 fp8 per head": (3.25, (32, 4, 2), "fp8", "head"),
    "split32 4+2 fp8 per layer": (3.25, (32, 4, 2), "fp8", "layer"),
    "split32 4+2 fp8 key energy": (3.25, (32, 4, 2), "fp8", "keys"),
    "split16 5+2 fp8 per head": (2.875, (16, 5, 2), "fp8", "head"),
    "split16 4+3 fp8 per head": (3.375, (16, 4, 3), "fp8", "head"),
}


def main(argv=None) -> int:
    from value_mean import prompt_record  # benchmarks/: the same prefill and recorded queries

    from qjl import CodecSpec

    a, cache, queries = prompt_record(argv, __doc__)

    def tq(bits, dim, seed, norm_dtype):
        spec = {"bits": bits, "correct_norm": True, "norm_dtype": norm_dtype}
        return CodecSpec("turboquant_mse", spec).build(dim, seed)

    def coded(codec, x):
        return codec.dequantize(codec.quantize(x.contiguous()))

    sinks, window = 4, 120
    totals = dict.fromkeys(CONFIGS, 0.0)
    for layer, cached in enumerate(cache.layers):
        k, v = cached.keys.float(), cached.values.float()
        q, scaling = queries[layer]
        q = q.float()
        n, h, d = k.shape[2], k.shape[1], k.shape[3]
        g = q.shape[1] // h
        fit, held = q[:, :, :32].reshape(1, h, g * 32, d), q[:, :, 32:].reshape(1, h, g * 32, d)
        causal = torch.arange(n)[None] <= torch.arange(n - 32, n)[:, None]  # held-out rows: the last 32 positions

        def output(keys):
            logits = torch.matmul(held, keys.transpose(-1, -2)).reshape(1, h, g, 32, n) * scaling
            return torch.matmul(logits.masked_fill(~causal, float("-inf")).softmax(-1), v.unsqueeze(2))

        exact = output(k)
        span = slice(sinks, n - window)
        mu = k[:, :, span].mean(2, keepdim=True)
        x = k - mu
        energy = x[:, :, span].square().mean(2)[0]  # [h, d]
        importance = energy * fit.square().mean(2)[0]
        for name, (_, group, norm_dtype, choice) in CONFIGS.items():
            xq = x.clone()
            if not isinstance(group, tuple):
                xq[:, :, span] = coded(tq(group, d, 1000 * layer + 7, norm_dtype), x[:, :, span])
            else:
                m, b1, b2 = group
                hi_codec, lo_codec = tq(b1, m, 1000 * layer + 11, norm_dtype), tq(b2, d - m, 1000 * layer + 13, norm_dtype)
                for head in range(h):
                    score = {"head": importance[head], "layer": importance.sum(0), "keys": energy[head]}[choice]
                    order = score.argsort(descending=True)
                    hi, lo = order[:m], order[m:]
                    seg = x[:, head:head + 1, span]
                    xq[:, head:head + 1, span, hi] = coded(hi_codec, seg[..., hi])
                    xq[:, head:head + 1, span, lo] = coded(lo_codec, seg[..., lo])
            out = output(xq + mu)
            totals[name] += float((out - exact).square().sum() / exact.square().sum())
    base = totals["k3 fp16"]
    print(f"text {a.text}, {a.tokens} tokens; held-out attention-output error summed over layers (x one 3-bit group):")
    for name, (bits, *_) in CONFIGS.items():
        print(f"  {name:28s} {bits:5.3f} bits  {totals[name]:.4f}  ({totals[name] / base:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
