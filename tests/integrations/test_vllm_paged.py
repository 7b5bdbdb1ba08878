"""The vLLM backend's paged storage and reference attention, without vLLM.

A small simulation of what vLLM does to one attention layer (random block tables, chunked
prefill, mixed prefill/decode batches, GQA, block sizes that sequences straddle) is checked
against a dense computation written independently: codes from ``codec.quantize`` of the whole
sequence, the sinks / window / current chunk exact, one softmax.
"""

import pytest
import torch

import qjl
from qjl.integrations.vllm.layout import PageLayout, exact_slot, layer_layout, content_bytes
from qjl.integrations.vllm.paged import page_fields, paged_decode_reference, history_codes
from qjl.integrations.vllm.step import StepPlan, forward_batch
from qjl.integrations.vllm.writes import write_codes
from qjl.integrations.vllm.settings import VLLMSettings

D = 64


def _quantize(codec, x):
    """The codes the pages hold: the C encoder's (its torch mirror) where it stores the codec, else the codec's.
    x [..., L, D]: a sequence's tokens from position 0."""
    from qjl import kernels
    from qjl.kernels.reference import encode_reference

    if not kernels.can_store_cpu(codec):
        return codec.quantize(x)
    return encode_reference(codec, x, torch.arange(x.shape[-2]))


def _bf16(*shape, gen):
    return torch.randn(*shape, generator=gen).bfloat16().float()


class Sim:
    """One layer's page pool and the sequences written into it."""

    def __init__(self, key_spec, value_spec, block_size=16, hkv=2, hq=6, sinks=2, window=5, num_blocks=24, seed=0,
                 planned=True, sliding=None):
        self.layout = PageLayout(key_spec.build(D, 7), value_spec.build(D, 8), D, block_size, torch.bfloat16,
                                 sinks, window, sliding_window=sliding)
        self.pages = torch.zeros(num_blocks, hkv, block_size, self.layout.content_bytes // 2, dtype=torch.bfloat16)
        self.fields = page_fields(self.layout, self.pages)
        self.gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.hkv, self.hq, self.bs = hkv, hq, block_size
        self.planned = planned
        self.seqs = {}  # id -> dict(k, v, blocks)

    def _table(self, ids):
        width = max(len(self.seqs[i]["blocks"]) for i in ids)
        return torch.tensor([self.seqs[i]["blocks"] + [0] * (width - len(self.seqs[i]["blocks"])) for i in ids])

    def step(self, chunks: dict, decode=None):
        """chunks: {seq id: new token count}; returns (outputs per seq [c, H_q, D], q per seq)."""
        ids = list(chunks)
        ks, vs, qs, slots, qsl, lens = [], [], [], [], [0], []
        for i in ids:
            s = self.seqs.setdefault(i, {"k": torch.empty(0, self.hkv, D), "v": torch.empty(0, self.hkv, D), "blocks": []})
            c, n0 = chunks[i], s["k"].shape[0]
            while len(s["blocks"]) * self.bs < n0 + c:
                s["blocks"].append(self.free.pop())
            k, v, q = _bf16(c, self.hkv, D, gen=self.gen), _bf16(c, self.hkv, D, gen=self.gen), _bf16(c, self.hq, D, gen=self.gen)
            s["k"], s["v"] = torch.cat([s["k"], k]), torch.cat([s["v"], v])
            pos = torch.arange(n0, n0 + c)
            slots.append(torch.tensor(s["blocks"])[pos // self.bs] * self.bs + pos % self.bs)
            ks.append(k), vs.append(v), qs.append(q)
            qsl.append(qsl[-1] + c), lens.append(n0 + c)
        k, v, q = torch.cat(ks), torch.cat(vs), torch.cat(qs)
        table, qsl, lens = self._table(ids), torch.tensor(qsl), torch.tensor(lens)
        if self.planned:  # as the backend does: one StepPlan for the step (here: for the one layer)
            lay = self.layout
            plan = StepPlan.build(qsl, lens, table, lay.block_size, lay.sinks, lay.window, torch.cat(slots),
                                  sliding_window=lay.sliding_window)
            write_codes(lay, self.fields, k, v, None, plan=plan)
        else:
            write_codes(self.layout, self.fields, k, v, torch.cat(slots))
            plan = None
        out = forward_batch(self.layout, self.fields, q, k, v, table, qsl, lens, D ** -0.5, decode, plan=plan)
        return {i: out[qsl[j]:qsl[j + 1]] for j, i in enumerate(ids)}, {i: qs[j] for j, i in enumerate(ids)}

    def fork(self, src, dst, n):
        """dst starts as the first n tokens of src, sharing its n / block_size full blocks (a prefix-cache hit)."""
        s = self.seqs[src]
        assert n % self.bs == 0
        self.seqs[dst] = {"k": s["k"][:n].clone(), "v": s["v"][:n].clone(), "blocks": s["blocks"][: n // self.bs]}

    def dense(self, i, q):
        """Independent dense attention of the last q.shape[0] tokens of sequence i."""
        s, lay = self.seqs[i], self.layout
        k, v = s["k"], s["v"]
        L, c = k.shape[0], q.shape[0]
        n = L - c
        kc = _quantize(lay.key_codec, k.transpose(0, 1))  # [H, L] codes of every token, as the pages hold them
        khat = lay.key_codec.dequantize(kc).transpose(0, 1)
        vhat = lay.value_codec.dequantize(_quantize(lay.value_codec, v.transpose(0, 1))).transpose(0, 1)
        exact = torch.zeros(L, dtype=torch.bool)
        exact[:min(lay.sinks, n)] = True
        # the window: the last sinks + window tokens past block 0 (later blocks ring over the sink slots too),
        # and before them block 0's last `window` (its own ring)
        exact[max(0, n - lay.sinks - lay.window, min(n, lay.block_size) - lay.window):] = True  # (and the chunk)
        kk, vv = torch.where(exact[:, None, None], k, khat), torch.where(exact[:, None, None], v, vhat)
        g = self.hq // self.hkv
        kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)  # [L, H_q, D]
        logits = torch.einsum("chd,lhd->hcl", q, kk) * D ** -0.5
        qpos = (n + torch.arange(c))[:, None]
        mask = torch.arange(L)[None, :] <= qpos
        if lay.sliding_window is not None:  # a token sees the W - 1 before it
            mask &= torch.arange(L)[None, :] > qpos - lay.sliding_window
        p = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("hcl,lhd->chd", p, vv)


TQ = qjl.CodecSpec("turboquant_mse", {"bits": 4, "correct_norm": True})
TQV = qjl.CodecSpec("turboquant_mse", {"bits": 3, "correct_norm": True, "norm_dtype": "fp8"})
UNI = qjl.CodecSpec("uniform", {"bits": 2, "group_size": 32})
# vector codebooks (qjl.codecs.vq): pairs at 3 bits, quads at 2 (the joint codes of preset tqv-k3v2)
VQK = qjl.CodecSpec("turboquant_vq", {"bits": 3, "correct_norm": True})
VQV = qjl.CodecSpec("turboquant_vq", {"bits": 2, "correct_norm": True, "norm_dtype": "fp8"})
# values over rotations in turn (token at position p by rotation p mod 8; preset tqv-k3v2's values)
TQC = qjl.CodecSpec("turboquant_mse", {"bits": 3, "correct_norm": True, "cycles": 8})
VQC = qjl.CodecSpec("turboquant_vq", {"bits": 2, "correct_norm": True, "norm_dtype": "fp8", "cycles": 8})


@pytest.mark.parametrize("kv,sinks,window", [((TQ, TQV), 0, 0), ((TQ, TQV), 2, 5), ((TQ, TQV), 4, 16),
                                             ((TQ, UNI), 2, 5), ((VQK, VQV), 0, 0), ((VQK, TQV), 2, 5),
                                             ((TQ, VQV), 2, 5), ((TQ, TQC), 2, 5), ((VQK, VQC), 0, 0),
                                             ((VQK, VQC), 4, 16), ((TQ, TQV), 4, 0), ((VQK, VQC), 4, 0)],
                         ids=["tq-none", "tq-2+5", "tq-4+16", "uniform-2+5", "vq-none", "vq-keys-2+5", "vq-values-2+5",
                              "tq-cycled-2+5", "vq-cycled-none", "vq-cycled-4+16", "tq-4+0", "vq-cycled-4+0"])
def test_mixed_batches_match_dense_attention(kv, sinks, window):
    sim = Sim(*kv, sinks=sinks, window=window)
    steps = [{"a": 20, "b": 1}, {"a": 17, "b": 1, "c": 16}, {"a": 1, "b": 1, "c": 1}, {"c": 3, "a": 1},
             {"a": 1, "b": 1, "c": 1}, {"b": 33}, {"a": 1, "b": 1, "c": 1}]
    for chunks in steps:
        outs, qs = sim.step(chunks)
        for i, o in outs.items():
            ref = sim.dense(i, qs[i])
            assert torch.allclose(o, ref, atol=2e-5, rtol=1e-4), (chunks, i, (o - ref).abs().max())


@pytest.mark.parametrize("sliding,window", [(24, 5), (9, 16), (1, 0)], ids=["w24", "w9-window-clamped", "w1"])
def test_sliding_window_layers_match_dense_attention(sliding, window):
    """A sliding-window layer (a token sees the W - 1 before it): no sinks (the settings' 2 are dropped), the exact
    window clamped to W - 1, chunks and decode rows reaching past the window, through the reference and the C
    kernel (decode rows), against the dense computation with the sliding mask."""
    from qjl.integrations.vllm.decode import paged_decode_kernel

    for decode in (None, paged_decode_kernel):
        sim = Sim(TQ, TQV, sinks=2, window=window, sliding=sliding, num_blocks=40)
        assert sim.layout.sinks == 0 and sim.layout.window == min(window, sliding - 1)
        for chunks in ({"a": 20, "b": 1}, {"a": 17, "b": 1, "c": 30}, {"a": 1, "b": 1, "c": 1}, {"c": 3, "a": 1},
                       {"a": 1, "b": 1, "c": 1}, {"b": 33}, {"a": 1, "b": 1, "c": 1}):
            outs, qs = sim.step(chunks, decode=decode)
            for i, o in outs.items():
                ref = sim.dense(i, qs[i])
                assert torch.allclose(o, ref, atol=2e-5, rtol=1e-4), (chunks, i, (o - ref).abs().max())


def test_blocks_no_longer_than_the_sinks_keep_sinks_and_window_apart():
    """Blocks of 4 tokens with 4 sinks and 2 window slots: the sinks fill block 0, and every later block rings its
    last 6 tokens over all 6 slots (none lands on a sink's cell): attention equals the dense reference."""
    sim = Sim(TQ, TQV, block_size=4, sinks=4, window=2, num_blocks=40)
    for chunks in ({"a": 9, "b": 3}, {"a": 1, "b": 1}, {"a": 6, "b": 5}, {"a": 1, "b": 1}, {"a": 1, "b": 1}):
        outs, qs = sim.step(chunks)
        for i, o in outs.items():
            assert torch.allclose(o, sim.dense(i, qs[i]), atol=2e-5, rtol=1e-4), (chunks, i)


@pytest.mark.parametrize("kv", [(TQ, TQV), (VQK, VQC)], ids=["tq", "vq-cycled"])
def test_prefix_cache_hit_reads_the_window_of_shared_blocks(kv):
    """A request continuing from another's full blocks (prefix caching) finds its exact window there, even
    when the first request prefilled those positions in the middle of a chunk (and, values over rotations in turn,
    the codes its positions imply)."""
    sim = Sim(*kv, block_size=16, sinks=2, window=5)
    sim.step({"a": 20})
    sim.step({"a": 20})  # positions 27..31 (block 1's last 5) sit mid-chunk
    sim.fork("a", "b", 32)
    for chunks in ({"b": 5}, {"b": 1, "a": 1}):
        outs, qs = sim.step(chunks)
        for i, o in outs.items():
            assert torch.allclose(o, sim.dense(i, qs[i]), atol=2e-5, rtol=1e-4), i


@pytest.mark.parametrize("kv", [(TQ, UNI), (VQK, VQV), (VQK, VQC)], ids=["tq-uniform", "vq", "vq-cycled"])
def test_codes_in_pages_are_the_codecs_codes(kv):
    """Bit-exact: what the pages hold is each token's codes from the C encoder (its torch mirror
    ``encode_reference``) where it serves the codec on the CPU, else codec.quantize's, whatever the block table."""
    sim = Sim(*kv, block_size=16)
    sim.step({"a": 23, "b": 40})
    sim.step({"a": 1, "b": 1})
    for i in ("a", "b"):
        s = sim.seqs[i]
        n = s["k"].shape[0]
        for role, x in (("key", s["k"]), ("value", s["v"])):
            got = history_codes({kk[len(role) + 1:]: f for kk, f in sim.fields.items() if kk.startswith(role + ".")},
                                torch.tensor(s["blocks"]), 0, n, 16, 2)
            codec = getattr(sim.layout, f"{role}_codec")
            want = _quantize(codec, x.transpose(0, 1))
            assert set(got.fields) == set(want.fields)
            for name, t in want.fields.items():
                assert torch.equal(got.fields[name].view(torch.uint8), t.view(torch.uint8)), (role, name)


PER_BLOCK_FIT = {  # key codecs with a per-block fit (a shared field): its name
    "qjl-outliers": (qjl.CodecSpec("qjl", {"n_outliers": 4, "sketch_dim": 128, "outlier_sketch_dim": 32}), "outlier_idx"),
    "tq-split": (qjl.CodecSpec("turboquant_split", {"bits": 2, "split_bits": 4, "n_split": 16}), "split_idx"),
}


@pytest.mark.parametrize("which", sorted(PER_BLOCK_FIT))
def test_keys_with_a_per_block_fit(which):
    """Keys whose codec fits per sequence (QJL's outlier channels, a split codec's chosen channels): fitted per
    (block, KV head) from the first tokens written to a block (keys alone: no queries there); attention equals the
    codec's own estimator with that fit."""
    keys, name = PER_BLOCK_FIT[which]
    sim = Sim(keys, UNI, sinks=0, window=0, block_size=16)
    outs, qs = sim.step({"a": 30})
    outs, qs = sim.step({"a": 1})
    s, lay = sim.seqs["a"], sim.layout
    kf = {kk[4:]: f for kk, f in sim.fields.items() if kk.startswith("key.")}
    codes = history_codes(kf, torch.tensor(s["blocks"]), 0, 30, 16, 2)
    idx0 = codes.shared[name][:, 0].long()
    want, = lay.key_codec.fit(s["k"][:16].transpose(0, 1))
    assert torch.equal(idx0, want)
    assert torch.equal(codes.shared[name][:, 16].long(), lay.key_codec.fit(s["k"][16:30].transpose(0, 1))[0])
    # decode output against the codec's estimator, block by block
    q = qs["a"][0].reshape(2, 3, D)
    logits = []
    for b0, b1 in ((0, 16), (16, 30)):
        c = lay.key_codec.quantize(s["k"][b0:b1].transpose(0, 1), codes.shared[name][:, b0].long())
        logits.append(lay.key_codec.inner_product(q, c))
    logits.append(torch.einsum("hgd,hd->hg", q, s["k"][30]).unsqueeze(-1))
    p = torch.softmax(torch.cat(logits, -1) * D ** -0.5, -1)
    vhat = lay.value_codec.dequantize(lay.value_codec.quantize(s["v"][:30].transpose(0, 1)))
    vv = torch.cat([vhat, s["v"][30].unsqueeze(1)], dim=1)
    ref = (p @ vv).reshape(6, D)
    assert torch.allclose(outs["a"][0], ref, atol=2e-5, rtol=1e-4)


def test_decode_contract_is_used_for_decode_rows():
    calls = []

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return paged_decode_reference(*args, **kw)

    sim = Sim(TQ, TQV)
    sim.step({"a": 5, "b": 1}, decode=spy)
    sim.step({"a": 1, "b": 1}, decode=spy)
    assert calls == [(1, 6, D), (2, 6, D)]


def test_layers_sharing_one_storage_address_their_own_bytes():
    """Two layers' page tensors carved from one allocation (as an engine may): each layer's fields start at its
    own bytes with the layout's offsets (so a step's address memos serve every layer), and a layer's writes never
    touch the other's pages."""
    lay = layer_layout(VLLMSettings(preset="tq-k45v3"), 3, 30, D, 16, torch.bfloat16)
    per = 6 * 2 * 16 * (lay.content_bytes // 2)
    store = torch.zeros(2 * per + 8, dtype=torch.bfloat16)
    pages = [store[8 + i * per: 8 + (i + 1) * per].view(6, 2, 16, lay.content_bytes // 2) for i in range(2)]
    f0, f1 = page_fields(lay, pages[0]), page_fields(lay, pages[1])
    for name in f0:
        assert (f0[name].offset, f0[name].stride_block) == (f1[name].offset, f1[name].stride_block), name
        assert f1[name].buffer.data_ptr() == pages[1].data_ptr()
    g = torch.Generator().manual_seed(0)
    k, v = _bf16(5, 2, D, gen=g), _bf16(5, 2, D, gen=g)
    write_codes(lay, f1, k, v, torch.tensor([0, 1, 2, 17, 95]))  # the last slot of layer 1's last block
    assert not pages[0].view(torch.int16).any() and not store[:8].view(torch.int16).any()
    assert pages[1].view(torch.int16).any()
    kf = {n[4:]: f for n, f in f0.items() if n.startswith("key.")}
    vf = {n[6:]: f for n, f in f0.items() if n.startswith("value.")}
    with pytest.raises(ValueError, match="reach past the end"):  # layer 0's block 6 would be layer 1's bytes
        qjl.kernels.paged_decode(torch.zeros(1, 2, 3, D), lay.key_codec, kf, lay.value_codec, vf,
                                 torch.tensor([[6]]), 16, torch.tensor([0]), torch.tensor([4]), backend="torch")


@pytest.mark.parametrize("sinks,window", [(4, 7), (4, 0), (0, 5), (2, 30)])
def test_exact_slots_ring(sinks, window):
    """Block 0 holds the sinks at their slots and its ring after them; later blocks ring over all E slots: the
    exact window of every history (window_start) has distinct cells (block, slot), none of them a sink's, all
    within E, and it holds min(n - sinks, sinks + window) tokens once past block 0 (the sink slots' free ring)."""
    from qjl.integrations.vllm.layout import window_start

    bs, e = 16, sinks + window
    pos = torch.arange(0, 200)
    sl = exact_slot(pos, sinks, window, block_size=bs)
    assert torch.equal(sl[:sinks], torch.arange(sinks)) and bool((sl[bs:] < e).all())
    if window:  # block 0's ring after its sinks (without one, block 0 keeps only its sinks exact)
        assert bool((sl[sinks:bs] >= sinks).all()) and bool((sl[sinks:bs] < e).all())
    for n in range(0, 200):
        w0 = max(sinks, window_start(n, sinks, window, block_size=bs))
        cells = [(p // bs, int(sl[p])) for p in range(min(sinks, n))] + [(p // bs, int(sl[p])) for p in range(w0, n)]
        assert len(set(cells)) == len(cells), n
        if n >= bs + e:
            assert n - w0 == e


def test_layout_fields_fit_and_do_not_overlap():
    for preset in ("tq-k45v3", "tq-k3v2", "qjl-paper"):
        s = VLLMSettings(preset=preset)
        width = content_bytes(s, D, 128, torch.bfloat16)
        for layer in (0, 29):
            lay = layer_layout(s, layer, 30, D, 128, torch.bfloat16)
            assert lay.content_bytes == width and width % 2 == 0
            spans = sorted((f.offset, f.offset + f.nbytes * (1 if f.shared else (s.sink_tokens + s.window_tokens if n.startswith("exact") else 128)))
                           for n, f in lay.fields.items())
            assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))
            assert spans[-1][1] <= lay.head_region_bytes


def test_layer_codecs_match_the_transformers_cache_seeds():
    """Layer l: keys seeded seed + 1000 l, values + 1, late layers wider: the codes equal QJLCacheLayer's."""
    s = VLLMSettings(preset="tq-k45v3")
    cfg = s.config
    x = torch.randn(3, 10, D)
    for layer in (0, 17, 29):
        lay = layer_layout(s, layer, 30, D, 128, torch.bfloat16)
        k, v = cfg.specs(layer, 30)
        ref_k, ref_v = k.build(D, cfg.seed + 1000 * layer), v.build(D, cfg.seed + 1000 * layer + 1)
        assert lay.key_codec.bits == ref_k.bits == (5 if layer >= 15 else 4)
        assert torch.equal(lay.key_codec.quantize(x).fields["codes"], ref_k.quantize(x).fields["codes"])
        assert torch.equal(lay.value_codec.quantize(x).fields["codes"], ref_v.quantize(x).fields["codes"])


def test_settings_refuse_bad_configuration(tmp_path):
    from qjl.integrations.vllm.settings import load_settings

    with pytest.raises(ValueError, match="QJL_VLLM_PRESET"):
        load_settings(environ={"QJL_VLLM_PRESET": "tq-k9"})
    with pytest.raises(ValueError, match="kivi"):
        load_settings(environ={"QJL_VLLM_PRESET": "kivi-k2v2"})
    with pytest.raises(ValueError, match="polarquant"):
        load_settings(environ={"QJL_VLLM_PRESET": "polar-k42v3"})
    with pytest.raises(ValueError, match="window"):
        load_settings({"qjl": {"window": -1}}, environ={"QJL_VLLM_PRESET": "tq-k45v3"})
    with pytest.raises(ValueError, match="unknown qjl setting"):
        load_settings({"qjl": {"windw": 3}}, environ={"QJL_VLLM_PRESET": "tq-k45v3"})
    bad = tmp_path / "q.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="QJL_VLLM_CONFIG"):
        load_settings(environ={"QJL_VLLM_CONFIG": str(bad)})
    good = tmp_path / "g.json"
    good.write_text('{"preset": "tq-k3v2", "window": 0}')
    s = load_settings({"qjl": {"sinks": 2}}, environ={"QJL_VLLM_CONFIG": str(good)})
    assert (s.preset, s.window_tokens, s.sink_tokens) == ("tq-k3v2", 0, 2)
    # the window default follows the preset, also when a later source changes the preset
    s = load_settings({"qjl": {"preset": "tq-k3v2"}}, environ={"QJL_VLLM_PRESET": "tq-k45v3"})
    assert s.window_tokens == 0 and VLLMSettings(preset="tq-k45v3").window_tokens == 4


def test_plugin_is_inert_without_the_environment(monkeypatch):
    from qjl.integrations import vllm as qv

    monkeypatch.delenv("QJL_VLLM_PRESET", raising=False)
    monkeypatch.delenv("QJL_VLLM_CONFIG", raising=False)
    assert qv.register() is None


def test_lean_import():
    import subprocess
    import sys

    code = "import sys, qjl.integrations.vllm; print('vllm' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_prefill_without_vllms_ops_is_the_reference(monkeypatch):
    """Where vLLM's CPU ops do not load (here: no vLLM, or a monkeypatched loader), ``VLLMPrefill`` is the torch
    reference, bit for bit, and says so (``usable`` False, never ``ran``)."""
    from qjl.integrations.vllm import prefill
    from qjl.integrations.vllm.paged import paged_attention_reference

    monkeypatch.setattr(prefill, "_cpu_ops", lambda: None)
    lay = layer_layout(VLLMSettings(preset="tq-k45v3"), 3, 8, 64, 16, torch.float32)
    pages = torch.zeros(8, 2, 16, lay.content_bytes // 4)
    fields = page_fields(lay, pages)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(40, 4, 64, generator=g), torch.randn(40, 2, 64, generator=g), torch.randn(40, 2, 64, generator=g)
    table = torch.arange(8)[None]
    plan = StepPlan.build(torch.tensor([0, 24]), torch.tensor([24]), table, 16, lay.sinks, lay.window)
    write_codes(lay, fields, k[:24], v[:24], None, plan=plan)
    forward_batch(lay, fields, q[:24], k[:24], v[:24], table, torch.tensor([0, 24]), torch.tensor([24]), 0.125, plan=plan)
    args = (q[24:], k[24:], v[24:], fields, table, torch.tensor([0, 16]), torch.tensor([40]), lay, 0.125)
    pre = prefill.VLLMPrefill()
    assert torch.equal(pre(*args), paged_attention_reference(*args))
    assert pre.usable is False and not pre.ran


def test_keys_over_rotations_in_turn_are_refused_by_name():
    """Keys over rotations in turn have no score view: the layout refuses them, naming the codec (values so coded
    are served: the simulations above)."""
    from qjl import TurboQuantMSE

    with pytest.raises(ValueError, match=r"key codec TurboQuantMSE\(.*cycles=8\).*rotations in turn"):
        PageLayout(TurboQuantMSE(D, 3, cycles=8), TurboQuantMSE(D, 2), D, 16, torch.bfloat16, 2, 8)
    PageLayout(TurboQuantMSE(D, 3), TurboQuantMSE(D, 2, cycles=8), D, 16, torch.bfloat16, 2, 8)


def test_values_over_rotations_in_turn_need_the_plan():
    """Such codes depend on each token's position, which a bare slot mapping does not give: refused before any
    page changes."""
    sim = Sim(TQ, VQC, planned=False)
    before = sim.pages.clone()
    with pytest.raises(ValueError, match=r"positions.*plan"):
        sim.step({"a": 5})
    assert torch.equal(sim.pages, before)


def test_vector_codebooks_take_the_scalar_codecs_bytes():
    """A vector codebook's joint codes are stored as its g b-bit fields: the same page bytes as the scalar codec (the
    layout, hence vLLM's block count, does not change), over one rotation or several in turn."""
    from qjl import TurboQuantMSE, TurboQuantVQ

    scalar = PageLayout(TurboQuantMSE(D, 3), TurboQuantMSE(D, 2), D, 16, torch.bfloat16, 2, 8)
    for values in (TurboQuantVQ(D, 2), TurboQuantVQ(D, 2, cycles=8)):
        vector = PageLayout(TurboQuantVQ(D, 3), values, D, 16, torch.bfloat16, 2, 8)
        assert vector.content_bytes == scalar.content_bytes
        assert {n: (f.dtype, f.shape) for n, f in vector.fields.items()} == \
               {n: (f.dtype, f.shape) for n, f in scalar.fields.items()}
