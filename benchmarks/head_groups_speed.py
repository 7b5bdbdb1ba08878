"""What coding a layer's KV heads in runs of their own codecs (widths per KV head, ``LayerStore.assign_heads``) costs a
decode step: one layer's attention of one new token (``qjl.cache.attention.attend``, the C kernel) over a store whose
KV heads share one pair of codecs, against the same store split into runs of heads that each hold the *same* pair
(so the codes, the bytes and the arithmetic are equal and only the grouping differs: since the sixth session of
2026-11-29 every run in one C call, ``DecodeHeads``; before it one call per run, the query and output sliced per
run).  A measurement, not a test.

    python benchmarks/head_groups_speed.py [--contexts 4096 8192] [--shapes smollm2 llama3] [--rounds 15] [--out runs]
    python benchmarks/head_groups_speed.py --e2e 8192      # and the embedded model end to end (below)

Shapes: the embedded model's layer (3 KV heads, 9 query heads, d = 64; runs 1+1+1 and 2+1) and one Llama-3-8B layer
(8 KV heads, 32 query heads, d = 128; runs 1 x 8 and 4+4).  Codecs: ``tqa-5x``'s most common pair (3-bit vector keys,
2-bit values over 8 rotations with fp8 norms); window 120, 4 sinks, key and value means as in the preset.
Interleaved rounds (every variant once per round), medians after 2 warm-up rounds.

``--e2e N``: the embedded model prefilled with N tokens of text (512-token chunks), then 24 greedy decode steps, with
the preset ``tqa-5x`` (widths per KV head) and the same configuration per layer (``per_head=False``): the layers
coded in runs of heads, the bytes held and the median decode step (after 2), both caches prefilled, then their
decode steps in turn (their widths differ, so this is the whole cost of choosing per head, not the grouping's
alone).  Writes
``<out>/head-groups-<time>/head_groups.json``.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from qjl.cache.attention import attend
from qjl.cache.config import CodecSpec, QJLConfig
from qjl.cache.storage import LayerStore

PAIR = (CodecSpec("turboquant_vq", {"bits": 3, "correct_norm": True}),
        CodecSpec("turboquant_mse", {"bits": 2, "correct_norm": True, "cycles": 8, "norm_dtype": "fp8"}))
SHAPES = {"smollm2": (3, 9, 64, [[1, 1, 1], [2, 1]]), "llama3": (8, 32, 128, [[1] * 8, [4, 4]])}
LAYER = 5


def _store(cfg, runs, k, v, q):
    """A store holding the prompt's keys and values ``k``, ``v`` [1, H, n, d] (``q`` [1, H_q, n, d] its queries),
    its KV heads coded in ``runs`` (None: one pair for the layer)."""
    store = LayerStore(LAYER, cfg)
    d = k.shape[-1]
    store.append(k, v)
    store.before_attention(None, q[:, :, -64:], d ** -0.5)
    if store.pending:
        seed = cfg.seed + 1000 * LAYER
        codecs = (PAIR[0].build(d, seed), PAIR[1].build(d, seed + 1))
        if runs is None:
            store.assign(*PAIR, codecs=codecs)
        else:
            starts = [sum(runs[:i]) for i in range(len(runs))]
            store.assign_heads([(slice(s, s + r), *PAIR, codecs) for s, r in zip(starts, runs)])
    store.after_attention()
    return store


def _e2e(context: int) -> list:
    """The embedded model with ``tqa-5x`` per KV head and per layer (see the module doc) -> rows."""
    from dataclasses import replace

    import qjl
    from qjl.cache.presets import PRESETS
    from qjl.tools.bench import long_text_ids
    from qjl.tools.models import load_model

    torch.set_grad_enabled(False)
    model, tok = load_model()
    qjl.patch_attention(model)
    ids = long_text_ids(tok, context)[None]
    base = PRESETS["tqa-5x"]
    caches, nxt, steps = {}, {}, {}
    for name, cfg in (("per KV head", base), ("per layer", replace(base, allocation=replace(base.allocation,
                                                                                              per_head=False)))):
        cache = caches[name] = qjl.QJLCache(model, cfg)
        out = None
        for s in range(0, context, 512):
            out = model(ids[:, s:s + 512], **qjl.cache_kwargs(cache), use_cache=True)
        nxt[name], steps[name] = out.logits[:, -1:].argmax(-1), []
    for _ in range(24):  # the two caches' decode steps in turn
        for name, cache in caches.items():
            t0 = time.perf_counter()
            out = model(nxt[name], **qjl.cache_kwargs(cache), use_cache=True)
            nxt[name] = out.logits[:, -1:].argmax(-1)
            steps[name].append(time.perf_counter() - t0)
    rows = []
    for name, cache in caches.items():
        grouped = sum(1 for layer in cache.layers if layer.store.groups is not None)
        ms = 1e3 * statistics.median(steps[name][2:])
        rows.append({"config": name, "context": context, "layers_in_runs": grouped, "bytes": cache.nbytes(),
                     "decode_ms": ms})
        print(f"e2e {context}: tqa-5x {name:12s} {grouped:2d} of {len(cache.layers)} layers in runs of heads, "
              f"{cache.nbytes() / 2**20:.2f} MiB, decode step {ms:.1f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--e2e", type=int, default=0, help="also the embedded model end to end at this context (0: not)")
    p.add_argument("--out", default="runs")
    a = p.parse_args(argv)
    cfg = QJLConfig.auto(3.0, residual_length=120, flush_block=8, exact_dtype="fp16", kernel="cpu")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in a.shapes:
        h, hq, d, variants = SHAPES[shape]
        for n in a.contexts:
            k, v, qp = (torch.randn(1, x, n, d, generator=gen) for x in (h, h, hq))
            stores = {"one pair": _store(cfg, None, k, v, qp)}
            for runs in variants:
                stores["runs " + "+".join(map(str, runs))] = _store(cfg, runs, k, v, qp)
            q = torch.randn(1, hq, 1, d, generator=gen)
            times = {name: [] for name in stores}
            outs = {}
            for r in range(a.rounds + 2):
                for name, store in stores.items():
                    t0 = time.perf_counter()
                    outs[name] = attend(store, q, None, d ** -0.5)
                    if r >= 2:
                        times[name].append(time.perf_counter() - t0)
            base = statistics.median(times["one pair"])
            for name, ts in times.items():
                err = float((outs[name] - outs["one pair"]).abs().max())
                rows.append({"shape": shape, "context": n, "variant": name, "median_ms": 1e3 * statistics.median(ts),
                             "x_one_pair": statistics.median(ts) / base, "max_abs_diff": err})
                print(f"{shape:8s} {n:6d} {name:18s} {1e3 * statistics.median(ts):8.3f} ms  "
                      f"{statistics.median(ts) / base:5.2f}x one pair  (outputs differ by {err:.1e})", flush=True)
    e2e = _e2e(a.e2e) if a.e2e else []
    out = Path(a.out) / time.strftime("head-groups-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_groups.json").write_text(json.dumps({"argv": sys.argv[1:], "threads": torch.get_num_threads(),
                                                      "rows": rows, "e2e": e2e}, indent=1))
    print(f"wrote {out / 'head_groups.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
