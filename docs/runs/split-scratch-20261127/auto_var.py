import sys, dataclasses, time, torch
from qjl.cache.config import QJLConfig
from qjl.cache.allocation import _tq
from qjl import patch_attention
from qjl.tools.evaluate import EvalSetup, load_text_ids, score_method, quality
from qjl.tools.models import load_model
text = sys.argv[1]; variants = sys.argv[2].split(","); ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 1536
torch.set_num_threads(1); torch.set_grad_enabled(False)
model, tok = load_model(); patch_attention(model)
setup = EvalSetup(context=ctx, score=512, chunk=32)
ids, _ = load_text_ids(tok, text, setup.tokens)
ref, _, _ = score_method(model, ids, setup, None)
targets = ids[setup.context: setup.tokens]
for v in variants:
    kind, seed = v.split(":")
    seed = int(seed)
    if kind == "old":
        cfg = QJLConfig.auto(3.0, key_candidates=tuple(_tq(k) for k in (3, 4, 5, 6)), seed=seed)
    elif kind == "new":  # (at the time SPLIT_KEYS were auto's default key candidates beside the single widths)
        from qjl.cache.allocation import SPLIT_KEYS
        cfg = QJLConfig.auto(3.0, seed=seed, key_candidates=tuple(_tq(k) for k in (3, 4, 5, 6)) + SPLIT_KEYS)
    elif kind == "half":
        from qjl.cache.allocation import _split
        cfg = QJLConfig.auto(3.0, seed=seed, key_candidates=tuple(_tq(k) for k in (3, 4, 5, 6)) + tuple(_split(0.5, a, b) for a, b in ((4, 2), (4, 3), (5, 3), (5, 4))))
    else:
        cfg = QJLConfig.named(kind, seed=seed)
    t = time.time()
    logp, c, _ = score_method(model, ids, setup, cfg)
    qm = quality(logp, targets, ref)
    print(text, v, {k: (round(x, 5) if isinstance(x, float) else x) for k, x in qm.items()}, f"{time.time()-t:.0f}s", flush=True)
    if kind in ("new", "half", "old"):
        ws = {}
        for i, layer in enumerate(c.layers):
            st = getattr(layer, "store", None)
            if st is not None and st.key_spec is not None:
                ws.setdefault((st.key_spec.describe(64), st.value_spec.describe(64)), []).append(i)
        print("  widths", ws, flush=True)
