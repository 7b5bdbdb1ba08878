import torch, sys
from qjl import patch_attention, QJLCache
from qjl.cache.config import QJLConfig
from qjl.tools.evaluate import load_text_ids
from qjl.tools.models import load_model
from qjl.integrations.transformers.attention import recording_queries
import qjl.cache.storage as st
torch.set_grad_enabled(False); torch.set_num_threads(2)
model, tok = load_model(); patch_attention(model)
same = diff = 0
orig = st.LayerStore._fit_keys
for text in sys.argv[1:]:
    ids, _ = load_text_ids(tok, text, 2048)
    blocks = {}
    def spy(self, block):
        blocks[self.layer_idx] = block.clone()
        return orig(self, block)
    st.LayerStore._fit_keys = spy
    rows = {}
    cache = QJLCache(model, QJLConfig.named("tq-ks3v3"))
    with recording_queries(lambda layer, q, mask, scaling, softcap: rows.setdefault(layer, q[:, :, -64:])):
        model(ids[None, :1536], past_key_values=cache)
    for li, block in blocks.items():
        s = cache.layers[li].store
        q = rows[li].float(); b, hq, r, d = q.shape
        full = q.reshape(b, s.heads, hq // s.heads * r, d)
        want, = s.key_codec.fit(block, queries=full)
        if torch.equal(want, s.key_fit[0]): same += 1
        else: diff += 1
print("split choices identical with the full rows:", same, "layers; differ:", diff, flush=True)
