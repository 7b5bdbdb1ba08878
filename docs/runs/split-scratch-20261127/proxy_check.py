import torch
from transformers import DynamicCache
from qjl import patch_attention
from qjl.cache.allocation import SPLIT_KEYS, _tq, distortions
from qjl.integrations.transformers.attention import recording_queries
from qjl.tools.evaluate import load_text_ids
from qjl.tools.models import load_model
torch.set_grad_enabled(False); torch.set_num_threads(1)
model, tok = load_model(); patch_attention(model)
ids, _ = load_text_ids(tok, "python-source", 2048)
qs = {}
with recording_queries(lambda layer, q, mask, scaling, softcap: qs.setdefault(layer, (q, scaling))):
    cache = DynamicCache(); model(ids[None], past_key_values=cache, use_cache=True)
t3 = _tq(3).build(64, 5); sp = SPLIT_KEYS[1].build(64, 5)
print("layer  proxyD(T3) proxyD(S) ratio | actual err T3  S  ratio")
tot = [0, 0, 0, 0]
for li, layer in enumerate(cache.layers):
    k, v = layer.keys.float(), layer.values.float()
    q, scaling = qs[li]; q = q.float()
    b, hq, n, d = q.shape; h = k.shape[1]; g = hq // h
    k = k - k[:, :, :1536].mean(2, keepdim=True)
    coded = slice(4, 1408)
    q5 = q[:, :, 1472:1536].reshape(b, h, g, 64, d)
    fitq, measq = q5[:, :, :, :32].reshape(b, h, -1, d), q5[:, :, :, 32:].reshape(b, h, -1, d)
    ks = k[:, :, coded]
    dt, ds = distortions([t3, sp], ks, fit=True, queries=(fitq, measq))
    # actual: continuation queries 1536..2047 over the coded prompt tokens, values exact, keys coded
    kt = t3.dequantize(t3.quantize(ks))
    fit = sp.fit(ks, queries=q[:, :, 1472:1536].reshape(b, h, -1, d))
    kss = sp.dequantize(sp.quantize(ks, *fit))
    qc = q[:, :, 1536:].reshape(b, h, g * 512, d)
    vv = v[:, :, coded]
    def out(keys):
        return torch.softmax(qc @ keys.transpose(-1, -2) * scaling, -1) @ vv
    o = out(ks)
    et = (out(kt) - o).square().sum().item(); es = (out(kss) - o).square().sum().item()
    tot[0] += dt; tot[1] += ds; tot[2] += et; tot[3] += es
    print(f"{li:3d}  {dt:.4f} {ds:.4f} {ds/dt:.2f} | {et:.4g} {es:.4g} {es/et:.2f}", flush=True)
print("sum actual T3 %.4g S %.4g ratio %.2f" % (tot[2], tot[3], tot[3]/tot[2]))
