"""A hybrid sliding-window model in the engine (``pytest -m vllm``): a tiny random Llama whose layers alternate
sliding-window (W = 32) and full attention, as vLLM reads Gemma-3-style ``layer_types``; the qjl backend against
vLLM's own CPU attention on the same model, teacher-forced over prompts of 40-150 tokens (prefill in 64-token
chunks, so the later chunks' history reaches past the window and vLLM frees the blocks behind it).

The first chunk is attended exactly by both (sliding mask inside the chunk included): equal within float error.
After it, the difference is the compression of the history (a high-bit preset), which must be several times
smaller than the difference the window itself makes (native attention on the same weights with every layer full).
The figures are printed (``-s``)."""

import pytest

from vllm_helpers import run_script, tiny_llama_dir

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-tp")]
pytest.importorskip("vllm")

SCRIPT = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model={model!r}, enforce_eager=True, dtype="float32", seed=0, max_model_len=512, block_size=32,
              max_num_batched_tokens=64, max_num_seqs=1)
    prompts = [[(7 * i + 3 * j) % 4000 + 100 for j in range(n)] for i, n in enumerate((40, 97, 150))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1, ignore_eos=True))
    json.dump({{"prompt": [[d[p[i]].logprob for i, d in enumerate(o.prompt_logprobs) if d is not None]
                          for o, p in zip(outs, prompts)], "tokens": [len(o.outputs[0].token_ids) for o in outs]}},
              open(sys.argv[1], "w"))
"""


def _gaps(a: dict, b: dict) -> tuple:
    """(largest |logprob difference| over the first 64-token chunk, mean over the rest) of two runs' prompts."""
    first, later = [], []
    for a_seq, b_seq in zip(a["prompt"], b["prompt"]):
        assert len(a_seq) == len(b_seq)
        for i, (x, y) in enumerate(zip(a_seq, b_seq)):  # entry i: the logprob of prompt token i + 1
            (first if i + 1 < 64 else later).append(abs(x - y))
    return max(first), sum(later) / len(later)


def test_hybrid_sliding_window_model_against_native(tmp_path):
    types = ["sliding_attention", "full_attention"] * 2
    model = tiny_llama_dir(tmp_path / "hybrid", layer_types=types, sliding_window=32)
    full = tiny_llama_dir(tmp_path / "full")  # the same weights (seeded), every layer full attention
    native = run_script(SCRIPT.format(model=model), tmp_path / "native")
    native_full = run_script(SCRIPT.format(model=full), tmp_path / "native-full")
    ours = run_script(SCRIPT.format(model=model), tmp_path / "qjl", {"QJL_VLLM_PRESET": "tq-k5v4"})
    assert "qjl backend: preset tq-k5v4" in ours["_log"] and ours["tokens"] == [8, 8, 8]
    first, later = _gaps(native, ours)
    _, window = _gaps(native, native_full)
    print(f"qjl vs native: first chunk max {first:.2e}, later mean {later:.4f}; the window's own effect {window:.4f}")
    assert first < 1e-3, first  # exact attention in the first chunk, the window's mask included
    assert later < window / 3, (later, window)  # ignoring the window would be as far off as native_full
