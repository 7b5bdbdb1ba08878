import sys, torch
sys.path.insert(0, "tests/cache")
from dataclasses import replace
from test_key_scale import _config, _kv, _prefill
from qjl.cache.storage import LayerStore
import qjl; print(qjl.__file__)
k, v, q = _kv(seed=2)
L = 60
pos = torch.arange(L)
m = (pos[None, :] <= pos[:, None])[None, None].expand(2, 1, -1, -1).clone()
m[1, ..., :5] = False
cfg = replace(_config(True), smooth_keys=False, sink_tokens=0)
def fit(keys):
    s = LayerStore(0, cfg); _prefill(s, keys[:, :, :L], v[:, :, :L], q[:, :, :L], m); return s.key_scale
k3 = k.clone(); k3[1, :, :5] = 100 * torch.randn(2, 5, 32)
print(fit(k), fit(k3))
