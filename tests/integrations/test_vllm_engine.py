"""qjl inside vLLM's offline engine on the embedded model (``pytest -m vllm``; one engine, ~2-4 min).

Many concurrent requests of different lengths, chunked prefill in 48-token chunks (mixed
prefill/decode batches), 16-token blocks that prompts straddle, a 24-block pool that cannot hold
the requests at once (vLLM queues them; its preemption counter stayed 0 in our runs, so
preemption + recomputation is not asserted here), and prefix caching on (repeated prompts hit
cached blocks).
"""

import pytest

from vllm_helpers import run_script

# two balanced halves for `-n 2` (.ci/run): engine + server (~190 s) and the two TP=2 tests (~190 s)
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-engine-server")]
pytest.importorskip("vllm")

SCRIPT = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from qjl.integrations.vllm.convert import vllm_model_dir
    llm = LLM(model=vllm_model_dir(), enforce_eager=True, dtype="float32", seed=0, max_model_len=320,
              block_size=16, max_num_batched_tokens=48, max_num_seqs=6, num_gpu_blocks_override=24,
              enable_prefix_caching=True, disable_log_stats=False)
    tok = llm.get_tokenizer()
    text = open("/usr/share/common-licenses/GPL-3").read()
    ids = tok(text)["input_ids"]
    lens = [5, 17, 33, 64, 150, 231, 90, 40]
    prompts = [ids[100 * i: 100 * i + n] for i, n in enumerate(lens)]
    prompts.append(prompts[5])  # prefix-cache hit on full blocks of a finished request
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    together = [list(o.outputs[0].token_ids) for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)]
    alone = [list(llm.generate([TokensPrompt(prompt_token_ids=p)], sp)[0].outputs[0].token_ids) for p in prompts[:2]]
    chat = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                    SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    stats = {m.name: getattr(m, "value", None) for m in llm.get_metrics()} if hasattr(llm, "get_metrics") else {}
    json.dump({"together": together, "alone": alone, "chat": chat,
               "preemptions": stats.get("vllm:num_preemptions"), "prefix_hits": stats.get("vllm:prefix_cache_hits")},
              open(sys.argv[1], "w"))
"""


def test_engine_concurrency_chunks_preemption_prefix_cache(tmp_path):
    """The engine runs everything vLLM throws at a backend.  Which tokens a chunk attends exactly depends on
    where the scheduler cuts chunks (the token budget is shared between requests), so outputs of one
    prompt run alone, together, or from the prefix cache agree at first and may drift later; exact
    agreement with a dense computation is what tests/integrations/test_vllm_paged.py checks."""
    r = run_script(SCRIPT, tmp_path, {"QJL_VLLM_PRESET": "tq-k45v3"}, timeout=1800)
    assert "qjl backend: preset tq-k45v3" in r["_log"]
    assert "decode qjl.integrations.vllm.decode.paged_decode_kernel" in r["_log"]  # the paged kernel by default
    assert all(len(t) == 16 for t in r["together"])
    assert r["together"][8][:4] == r["together"][5][:4]  # the repeated prompt, its prefix from the cache
    for x, y in zip(r["together"][:2], r["alone"]):
        assert x[:3] == y[:3], (x, y)
    assert "paris" in r["chat"].lower(), r["chat"]
    if r["prefix_hits"] is not None:
        assert r["prefix_hits"] > 0


def test_engine_serves_vector_codebooks_over_rotations_in_turn(tmp_path):
    """The 5x preset tqv-k3v2 in the same engine run: vector-codebook keys and values, the values coded over 8
    rotations in turn by each token's position (chunked prefill, mixed batches, prefix-cache hits).  At 5x the
    repeated prompt, whose first chunk attends the cached blocks' codes where its first run attended its own chunk
    exactly, may drift from the first run early (2026-11-29: after 2 tokens; tq-k3v2 at its first token), so it is
    not compared here: that reused blocks hold the codes their positions imply is checked exactly against a dense
    computation in test_vllm_paged.py (prefix-cache forks with values over rotations in turn)."""
    r = run_script(SCRIPT, tmp_path, {"QJL_VLLM_PRESET": "tqv-k3v2"}, timeout=1800)
    assert "qjl backend: preset tqv-k3v2" in r["_log"]
    assert all(len(t) == 16 for t in r["together"])
    for x, y in zip(r["together"][:2], r["alone"]):
        assert x[:3] == y[:3], (x, y)
    assert "paris" in r["chat"].lower(), r["chat"]
    if r["prefix_hits"] is not None:
        assert r["prefix_hits"] > 0
