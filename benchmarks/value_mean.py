"""Which mean value smoothing should subtract: none, the plain channel mean, or the attention-weighted one.

A measurement, not a test (docs/cache.md, "Value smoothing").  One full-precision prefill of ``--tokens`` tokens of a
text through the embedded model; per layer, the prompt's keys, values and its last 64 queries (recorded with
``recording_queries``).  Each mean is fitted on the first 32 of those queries; the attention output of the other 32
(held out) is computed with the values coded (2-bit TurboQuant, fp8 norms: ``tq-k3v2``'s value codec) between the 4
sinks and the 136-token window, and compared with the exact output.  Prints, per layer and summed over layers, the
squared output error relative to the exact output's energy, and the codec's own relative error on the values.

    python benchmarks/value_mean.py --text licenses
"""

from __future__ import annotations

import argparse

import torch


from qjl.integrations.transformers.names import cache_kwargs

def prompt_record(argv=None, doc: str = __doc__) -> tuple:
    """The options ``--text``, ``--tokens``, ``--threads`` parsed from ``argv`` (``doc``: the script's docstring, for
    ``--help``), then one full-precision prefill of the text: (options, the prefill's ``DynamicCache``, {layer: (its
    last 64 query rows, scaling)})."""
    from transformers import DynamicCache

    from qjl import patch_attention
    from qjl.integrations.transformers.attention import recording_queries
    from qjl.tools.evaluate import load_text_ids
    from qjl.tools.models import load_model

    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--text", default="licenses")
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    model, tok = load_model()
    patch_attention(model)
    ids, _ = load_text_ids(tok, a.text, a.tokens)
    queries = {}
    with recording_queries(lambda layer, q, mask, scaling, softcap: queries.setdefault(layer, (q[:, :, -64:], scaling))):
        cache = DynamicCache()
        model(ids[None], **cache_kwargs(cache), use_cache=True)
    return a, cache, queries


def main(argv=None) -> int:
    from qjl import CodecSpec
    from qjl.cache.smoothing import attention_weighted_mean

    _, cache, queries = prompt_record(argv)
    spec = CodecSpec("turboquant_mse", {"bits": 2, "correct_norm": True, "norm_dtype": "fp8"})
    sinks, window = 4, 136
    totals = {"none": 0.0, "plain": 0.0, "weighted": 0.0}
    print(f"{'layer':>5} {'none':>9} {'plain':>9} {'weighted':>9}   codec rel. MSE none -> plain")
    for layer, cached in enumerate(cache.layers):
        k, v = cached.keys.float(), cached.values.float()
        q, scaling = queries[layer]
        q = q.float()
        n, h, g = k.shape[2], k.shape[1], q.shape[1] // k.shape[1]
        fit, held = q[:, :, :32], q[:, :, 32:]
        pos = torch.arange(n)
        causal = pos[None] <= torch.arange(n - 32, n)[:, None]  # the held-out rows are the last 32 positions
        logits = torch.matmul(held.reshape(1, h, g * 32, -1), k.transpose(-1, -2)).reshape(1, h, g, 32, n) * scaling
        p_ = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        exact = torch.matmul(p_, v.unsqueeze(2))
        fit_mask = pos[None] <= torch.arange(n - 64, n - 32)[:, None]
        means = {"none": torch.zeros_like(v[:, :, 0]),
                 "plain": attention_weighted_mean(v, None, sinks, window),
                 "weighted": attention_weighted_mean(v, None, sinks, window, fit, k, fit_mask[None, None], scaling)}
        codec = spec.build(v.shape[-1], 1000 * layer + 1)
        coded = slice(sinks, n - window)
        row, mse = [], []
        for name, mu in means.items():
            x = v - mu.unsqueeze(2)
            xq = x.clone()
            xq[:, :, coded] = codec.dequantize(codec.quantize(x[:, :, coded]))
            out = torch.matmul(p_, xq.unsqueeze(2)) + mu[:, :, None, None]
            err = float((out - exact).square().sum() / exact.square().sum())
            totals[name] += err
            row.append(err)
            mse.append(float((xq - x)[:, :, coded].square().sum() / v[:, :, coded].square().sum()))
        print(f"{layer:>5} {row[0]:9.5f} {row[1]:9.5f} {row[2]:9.5f}   {mse[0]:.4f} -> {mse[1]:.4f}")
    base = totals["none"]
    print("sum over layers: " + ", ".join(f"{k} {v:.4f} ({v / base:.2f}x)" for k, v in totals.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
