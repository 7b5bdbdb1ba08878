import sys, dataclasses, time, torch
from qjl.cache.config import QJLConfig
from qjl.cache.presets import _tq, _split
from qjl import patch_attention
from qjl.tools.evaluate import EvalSetup, load_text_ids, score_method, quality
from qjl.tools.models import load_model
text = sys.argv[1]; variants = sys.argv[2].split(",")
torch.set_num_threads(1); torch.set_grad_enabled(False)
model, tok = load_model(); patch_attention(model)
setup = EvalSetup(context=1536, score=512, chunk=32)
ids, _ = load_text_ids(tok, text, setup.tokens)
ref, _, _ = score_method(model, ids, setup, None)
targets = ids[setup.context: setup.tokens]
base = QJLConfig.named("tq-k3v3")
for v in variants:
    kind, seed = v.split(":"); seed = int(seed)
    key = _tq(3) if kind == "t3" else _split(0.5, 4, 2)
    cfg = dataclasses.replace(base, key=key, value=_tq(2, norm_dtype="fp8"), seed=seed)
    t = time.time()
    logp, c, _ = score_method(model, ids, setup, cfg)
    qm = quality(logp, targets, ref)
    print(text, v, {k: (round(x, 5) if isinstance(x, float) else x) for k, x in qm.items()}, f"{time.time()-t:.0f}s", flush=True)
