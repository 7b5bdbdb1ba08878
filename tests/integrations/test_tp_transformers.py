"""transformers' own tensor parallelism (``tp_plan="auto"`` under ``torchrun --nproc-per-node 2``, gloo on
the CPU) with :class:`qjl.QJLCache` gives the same tokens and logits as one process.

Every rank holds a subset of the KV heads; the codecs are seeded per layer only (``seed + 1000 l``),
so each head is quantized identically whichever rank holds it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# two processes for a minute or more on two busy cores: run with the engine tests (`pytest -m vllm`)
# two balanced halves for `-n 2` (.ci/run): engine + server (~190 s) and the two TP=2 tests (~190 s)
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-tp")]

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, transformers as tf
    import qjl
    sys.path.insert(0, {tests!r})
    from tiny_models import tiny_model
    path, out = sys.argv[1], sys.argv[2]

    def qjl_head_specs(store):  # (key spec, value spec) of each KV head the store holds
        if store.groups is None:
            return [(store.key_spec, store.value_spec)] * store.heads
        return [(g.key_spec, g.value_spec) for g in store.groups for _ in range(g.heads.stop - g.heads.start)]

    tp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not tp:
        tiny_model("llama", dtype=torch.float32, seed=3).save_pretrained(path)
    else:
        torch.distributed.init_process_group("gloo")
        torch.distributed.barrier()
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **({{"tp_plan": "auto"}} if tp else {{}})).eval()
    qjl.patch_attention(model)
    # an fp32 window: fp16 storage rounds the ranks' 1e-7 float differences to different fp16 values now and
    # then, which flips codes later (measured 3.6e-3 on the logits, same tokens)
    # heavy tokens on (the preset's 16): chosen from the attention summed over every rank's KV heads (an all-reduce)
    cfg = qjl.QJLConfig.preset("tq-k45v3", residual_length=8, flush_block=4, kernel="torch", exact_dtype=None)
    ids = torch.tensor([[(5 * j + 11) % 90 + 3 for j in range(48)]])
    cache = qjl.QJLCache(model, cfg)
    with torch.no_grad():
        gen = model.generate(ids, **qjl.cache_kwargs(cache), max_new_tokens=12, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        # auto widths: each layer's error terms summed over the ranks' heads, so every rank chooses alike; per layer
        # and per KV head (each rank gathers every head's terms and keeps its own heads' picks; no heavy tokens
        # there: each rank holds its own copy of their positions, which leaves a rank's codes a little less of the
        # budget than one process's, and so other picks)
        autos = {{}}
        for per_head in (False, True):
            autos[per_head] = qjl.QJLCache(model, qjl.QJLConfig.auto(3.0 if per_head else 4.0, residual_length=8,
                                                                    flush_block=4, kernel="torch", exact_dtype=None,
                                                                    per_head=per_head,
                                                                    heavy_tokens=0 if per_head else 16))
            model(torch.tensor([[(7 * j + 5) % 90 + 3 for j in range(400)]]), **qjl.cache_kwargs(autos[per_head]))
        auto, heads = autos[False], autos[True]
        # each rank's heads' codecs: (key spec, value spec) per KV head it holds, gathered in rank order
        mine = [[repr(qjl_pair) for qjl_pair in qjl_head_specs(l.store)] for l in heads.layers]
        if tp:
            got = [None] * int(os.environ["WORLD_SIZE"])
            torch.distributed.all_gather_object(got, mine)
            mine = [sum((g[i] for g in got), []) for i in range(len(mine))]
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        json.dump({{"tokens": gen.sequences[0].tolist(), "scores": [s[0].tolist() for s in gen.scores],
                   "key_bits": [l.store.key_codec.bits for l in cache.layers],
                   "heavy": [l.store.heavy_pos.tolist() for l in cache.layers],
                   "auto": [repr((l.store.key_spec, l.store.value_spec)) for l in auto.layers],
                   "per_head": mine,
                   "head_terms": [[h[t] for h in l.store.auto_stats["heads"] for t in ("s_k", "s_v")]
                                  for l in heads.layers],
                   "auto_terms": [[l.store.auto_stats["s_k"], l.store.auto_stats["s_v"],
                                   *(d for _, d in l.store.auto_stats["keys"] + l.store.auto_stats["values"])]
                                  for l in auto.layers]}}, open(out, "w"))
    if tp:
        torch.distributed.destroy_process_group()
""")


def _run(cmd, env):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def test_transformers_tp2_with_qjlcache_equals_one_process(tmp_path):
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT.format(tests=tests))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    model, one, two = tmp_path / "model", tmp_path / "one.json", tmp_path / "two.json"
    _run([sys.executable, str(script), str(model), str(one)], env)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
          str(script), str(model), str(two)], env)
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert a["key_bits"] == b["key_bits"]
    assert a["heavy"] == b["heavy"] and all(len(h[0]) == 16 for h in a["heavy"])
    assert a["auto"] == b["auto"] and len(set(a["auto"])) > 1  # the same widths, and not one width everywhere
    # the error terms they were chosen from: every KV head's, on every rank (rank 0 alone holds one of two heads)
    assert sum(a["auto_terms"], []) == pytest.approx(sum(b["auto_terms"], []), rel=1e-4)
    # per KV head: every head's terms gathered on every rank, and each head coded as in one process
    assert sum(a["head_terms"], []) == pytest.approx(sum(b["head_terms"], []), rel=1e-4)
    assert a["per_head"] == b["per_head"]
    assert any(len(set(h)) > 1 for h in a["per_head"])  # some layer's two heads differ (one on each rank)
    assert a["tokens"] == b["tokens"]
    worst = max(abs(x - y) for sa, sb in zip(a["scores"], b["scores"]) for x, y in zip(sa, sb))
    assert worst < 1e-4, worst
