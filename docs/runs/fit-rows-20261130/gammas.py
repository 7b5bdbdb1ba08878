import sys, torch
from qjl import QJLCache, QJLConfig, cache_kwargs, patch_attention
import qjl
from qjl.tools.models import load_model
from qjl.tools.evaluate import load_text_ids
print(qjl.__file__, file=sys.stderr)
torch.set_grad_enabled(False)
model, tok = load_model(); patch_attention(model)
ids = load_text_ids(tok, "/usr/share/common-licenses/GPL-3", 1536)[0].unsqueeze(0)
out = {}
for name in ("tqa-5x",):
    cache = QJLCache(model, QJLConfig.preset(name))
    model(ids, **cache_kwargs(cache)); model(ids[:, -1:], **cache_kwargs(cache))
    out[name] = torch.stack([l.store.key_scale for l in cache.layers])
# padded batch of two: row 1 left-padded by 7
ids2 = torch.cat([ids[:, :1000], torch.cat([torch.full((1, 7), tok.pad_token_id or 0), ids[:, :993]], 1)])
mask = torch.ones(2, 1000, dtype=torch.long); mask[1, :7] = 0
cache = QJLCache(model, QJLConfig.preset("tqa-5x"))
model(ids2, attention_mask=mask, **cache_kwargs(cache))
model(ids2[:, -1:], attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1), **cache_kwargs(cache))
out["padded"] = torch.stack([l.store.key_scale for l in cache.layers])
torch.save(out, sys.argv[1])
