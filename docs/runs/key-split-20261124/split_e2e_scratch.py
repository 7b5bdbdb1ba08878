"""Scratch: end-to-end effect of keys split by channel importance (per KV head, from the prompt's queries)."""
import sys, dataclasses, torch
from transformers import DynamicCache
from qjl import CodecSpec, patch_attention
from qjl.codecs import registry
from qjl.codecs.base import BitBudget, Codec, Codes
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.cache.config import QJLConfig
from qjl.integrations.transformers.attention import recording_queries
from qjl.tools.evaluate import EvalSetup, load_text_ids, score_method, quality
from qjl.tools.models import load_model

ORDERS = {}

from qjl.codecs.params import Param, integer, seed as seed_param
from qjl.codecs.turboquant import NORM_DTYPES
from qjl.codecs.params import choice
class SplitTQ(Codec):
    name = "tq_split"
    params = {"m": Param(integer(1, 512)), "b1": Param(integer(1, 8)), "b2": Param(integer(1, 8)), "seed": Param(seed_param),
              "norm_dtype": Param(choice(*NORM_DTYPES, *NORM_DTYPES.values()))}
    def __init__(self, dim, m=32, b1=4, b2=2, norm_dtype="fp8", seed=0):
        self.dim, self.m, self.layer = dim, m, seed // 1000
        self.hi = TurboQuantMSE(m, b1, seed=seed + 11, correct_norm=True, norm_dtype=norm_dtype)
        self.lo = TurboQuantMSE(dim - m, b2, seed=seed + 13, correct_norm=True, norm_dtype=norm_dtype)
    def fit(self, x): return ()
    def _perm(self, x):
        o = ORDERS[self.layer].to(x.device)
        assert x.ndim == 4 and x.shape[1] == o.shape[0], x.shape
        return o[None, :, None, :].expand(x.shape[0], -1, x.shape[2], -1)
    def quantize(self, x):
        xp = torch.gather(x.float(), -1, self._perm(x))
        c1, c2 = self.hi.quantize(xp[..., :self.m].contiguous()), self.lo.quantize(xp[..., self.m:].contiguous())
        return Codes(c1.lead, {**{"h_" + k: v for k, v in c1.fields.items()}, **{"l_" + k: v for k, v in c2.fields.items()}})
    def dequantize(self, codes):
        f = codes.fields
        c1 = Codes(codes.lead, {k[2:]: v for k, v in f.items() if k.startswith("h_")})
        c2 = Codes(codes.lead, {k[2:]: v for k, v in f.items() if k.startswith("l_")})
        xp = torch.cat([self.hi.dequantize(c1), self.lo.dequantize(c2)], -1)
        out = torch.empty_like(xp)
        return out.scatter_(-1, self._perm(xp), xp)
    def bit_budget(self):
        a, b = self.hi.bit_budget(), self.lo.bit_budget()
        return BitBudget(self.dim, {"h_" + k: v for k, v in a.per_vector.items()} | {"l_" + k: v for k, v in b.per_vector.items()})
    def norm_limit(self): return min(self.hi.norm_limit(), self.lo.norm_limit())

registry.CODECS["tq_split"] = SplitTQ
text = sys.argv[1] if len(sys.argv) > 1 else "python-source"
torch.set_num_threads(2); torch.set_grad_enabled(False)
model, tok = load_model(); patch_attention(model)
setup = EvalSetup(context=1536, score=512, chunk=32)
ids, _ = load_text_ids(tok, text, setup.tokens)
queries = {}
with recording_queries(lambda layer, q, mask, scaling, softcap: queries.setdefault(layer, q[:, :, -64:])):
    cache = DynamicCache(); model(ids[None, :setup.context], past_key_values=cache, use_cache=True)
for layer, cached in enumerate(cache.layers):
    k = cached.keys.float(); q = queries[layer].float()
    h, d = k.shape[1], k.shape[3]; n = k.shape[2]
    x = k[:, :, 4:n - 120]; x = x - x.mean(2, keepdim=True)
    imp = x.square().mean(2)[0] * q.reshape(1, h, -1, d).square().mean(2)[0]
    ORDERS[layer] = imp.argsort(-1, descending=True)
del cache
base = QJLConfig.named("tq-k3v3")
cfgs = {"tq-k3v3": base,
        "k split32 4+2 fp8": dataclasses.replace(base, key=CodecSpec("tq_split", {"m": 32, "b1": 4, "b2": 2, "norm_dtype": "fp8"})),
        "k split16 5+2 fp8": dataclasses.replace(base, key=CodecSpec("tq_split", {"m": 16, "b1": 5, "b2": 2, "norm_dtype": "fp8"})),
        "k3 fp8": dataclasses.replace(base, key=CodecSpec("turboquant_mse", {"bits": 3, "correct_norm": True, "norm_dtype": "fp8"}))}
ref, _, _ = score_method(model, ids, setup, None)
targets = ids[setup.context: setup.tokens]
for name, cfg in cfgs.items():
    logp, c, _ = score_method(model, ids, setup, cfg)
    qm = quality(logp, targets, ref)
    print(text, name, {k: (round(v, 5) if isinstance(v, float) else v) for k, v in qm.items()}, flush=True)
