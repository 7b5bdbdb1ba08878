"""Tensor parallelism: TP=2 gives the same tokens and logprobs as TP=1 with the qjl backend
(``pytest -m vllm``; a tiny random Llama with 4 query / 2 KV heads, fp32, two workers).

The backend's outputs depend on where the scheduler cuts prefill chunks (each chunk is attended exactly, its
history from codes; docs/vllm.md), and with several requests in flight vLLM's cuts depend on when each request
reaches the engine, which differs from run to run.  ``max_num_seqs=1`` makes the schedule a function of the
prompts alone (chunks of 64 tokens from each prompt's start), so TP=1 and TP=2 see the same cuts: prefill
chunks that attend to compressed history, decode over codes, several blocks per sequence.  In a run where both degrees got
the same cuts, every layer's attention output agreed to 2e-6 (relative) and the logprobs to 2e-6; in runs with
different cuts, prompt logprobs differed by up to 0.36 from the first chunk that started at another token."""

import pytest

from vllm_helpers import run_script, tiny_llama_dir

# two balanced halves for `-n 2` (.ci/run): engine + server (~190 s) and the two TP=2 tests (~190 s)
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-tp")]
pytest.importorskip("vllm")

SCRIPT = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model={model!r}, enforce_eager=True, dtype="float32", seed=0, max_model_len=512, block_size=16,
              tensor_parallel_size={tp}, max_num_batched_tokens=64, max_num_seqs=1,
              distributed_executor_backend="mp")
    prompts = [[(7 * i + 3 * j) % 4000 + 100 for j in range(n)] for i, n in enumerate((40, 97, 150))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, logprobs=3, prompt_logprobs=1, ignore_eos=True))
    json.dump({{"tokens": [list(o.outputs[0].token_ids) for o in outs],
               "logprobs": [[{{str(t): lp.logprob for t, lp in d.items()}} for d in o.outputs[0].logprobs] for o in outs],
               "prompt": [[d[p[i]].logprob for i, d in enumerate(o.prompt_logprobs) if d is not None]
                          for o, p in zip(outs, prompts)]}},
              open(sys.argv[1], "w"))
"""


def test_tp2_equals_tp1(tmp_path):
    model = tiny_llama_dir(tmp_path / "tiny")
    env = {"QJL_VLLM_PRESET": "tq-k45v3"}
    r1 = run_script(SCRIPT.format(model=model, tp=1), tmp_path / "tp1", env)
    r2 = run_script(SCRIPT.format(model=model, tp=2), tmp_path / "tp2", {**env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert r1["tokens"] == r2["tokens"]
    worst = 0.0
    for a_seq, b_seq in zip(r1["logprobs"], r2["logprobs"]):
        for a, b in zip(a_seq, b_seq):
            for t in set(a) & set(b):
                worst = max(worst, abs(a[t] - b[t]))
    for a_seq, b_seq in zip(r1["prompt"], r2["prompt"]):  # teacher-forced: chunks after the first read codes
        assert len(a_seq) == len(b_seq)
        worst = max([worst] + [abs(a - b) for a, b in zip(a_seq, b_seq)])
    assert worst < 1e-3, worst
