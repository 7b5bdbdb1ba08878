import sys, dataclasses, time, torch
from qjl import CodecSpec, patch_attention
from qjl.cache.config import QJLConfig
from qjl.tools.evaluate import EvalSetup, load_text_ids, score_method, quality
from qjl.tools.models import load_model
import qjl.codecs.split as sp
text = sys.argv[1]; variants = sys.argv[2].split(",")
torch.set_num_threads(1); torch.set_grad_enabled(False)
model, tok = load_model(); patch_attention(model)
setup = EvalSetup(context=1536, score=512, chunk=32)
ids, _ = load_text_ids(tok, text, setup.tokens)
base = QJLConfig.named("tq-k3v3")
ref, _, _ = score_method(model, ids, setup, None)
targets = ids[setup.context: setup.tokens]
orig_fit = sp.SplitTurboQuant.fit
for v in variants:
    name, *opts = v.split(":")
    m, b1, b2 = (int(x) for x in name.split("-"))
    seed, pairs = 0, "none"
    sp.SplitTurboQuant.fit = orig_fit
    for o in opts:
        if o.startswith("seed"): seed = int(o[4:])
        if o in ("half", "adjacent"): pairs = o
        if o == "keysonly": sp.SplitTurboQuant.fit = lambda self, x, queries=None: orig_fit(self, x)
        if o == "qonly": sp.SplitTurboQuant.fit = lambda self, x, queries=None: (torch.sort(queries.square().mean(-2), -1, descending=True).indices[..., :self.n_split].sort(-1).values,)
    cfg = dataclasses.replace(base, seed=seed) if m == 0 else dataclasses.replace(base, seed=seed, key=CodecSpec("turboquant_split", {"n_split": m, "split_bits": b1, "bits": b2, "norm_dtype": "fp8", "correct_norm": True}))
    t = time.time()
    logp, c, _ = score_method(model, ids, setup, cfg)
    qm = quality(logp, targets, ref)
    print(text, v, {k: (round(x, 5) if isinstance(x, float) else x) for k, x in qm.items()}, f"{time.time()-t:.0f}s", flush=True)
