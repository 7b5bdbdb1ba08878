"""lm-eval's model ``qjl``: loglikelihood and generation run through the compressed cache.

Marked ``lm_eval`` and skipped without the package (``pip install -e ".[lm-eval]"``; run with
``python -m pytest -m lm_eval tests/integrations/test_lm_eval.py``).  A tiny random Llama with a byte-level
tokenizer stands in for a real model; a local task (JSON lines written here) stands in for the hub's.
"""

import importlib.util
import json

import pytest
import torch

pytestmark = [pytest.mark.lm_eval,
              pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval not installed")]

CONTEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 5)


@pytest.fixture(scope="module")
def lm_pair():
    from byte_lm import byte_llama, byte_tokenizer

    return byte_llama(), byte_tokenizer()


def _make(lm_pair, preset, **kw):
    from qjl.integrations.lm_eval import QJLLM

    model, tok = lm_pair
    return QJLLM(pretrained=model, tokenizer=tok, preset=preset, max_length=2048, **kw)


def _requests(pairs):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]


PAIRS = [(CONTEXT + "Question: what jumps?", " the fox"), (CONTEXT + "Question: what jumps?", " the dog"),
         (CONTEXT[:200], " sleeps"), ("Short context.", " yes")]


def test_full_precision_path_equals_hflm(lm_pair):
    from lm_eval.models.huggingface import HFLM

    model, tok = lm_pair
    ours = _make(lm_pair, "none", chunk=4).loglikelihood(_requests(PAIRS))
    theirs = HFLM(pretrained=model, tokenizer=tok, max_length=2048).loglikelihood(_requests(PAIRS))
    for (a, ga), (b, gb) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-3) and ga == gb
    # perplexity tasks (loglikelihood_rolling) go through the same path
    from lm_eval.api.instance import Instance

    docs = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(CONTEXT,), idx=0)]
    ours = _make(lm_pair, "none", chunk=16).loglikelihood_rolling(docs)
    theirs = HFLM(pretrained=model, tokenizer=tok, max_length=2048).loglikelihood_rolling(docs)
    assert ours[0] == pytest.approx(theirs[0], abs=1e-2)


def test_loglikelihood_reads_the_compressed_context(lm_pair, monkeypatch):
    from qjl import QJLConfig

    # exact tokens in the model's float32 (the default "half" would round them: ~1e-3 in log-probs)
    lm = _make(lm_pair, QJLConfig.preset("tq-k2v2", exact_dtype="fp32"))
    made = []
    make = lm.make_cache
    monkeypatch.setattr(lm, "make_cache", lambda: made.append(make()) or made[-1])
    compressed = lm.loglikelihood(_requests(PAIRS))
    exact = _make(lm_pair, "none").loglikelihood(_requests(PAIRS))
    assert len(made) == 3  # one prefill per distinct context
    # the two long contexts (400 and 200 bytes) left the exact window (4 sinks + 128 tokens); the short one did not
    assert sorted(c.memory_report()["key_code_bytes"] > 0 for c in made) == [False, True, True]
    diffs = [abs(a - b) for (a, _), (b, _) in zip(compressed, exact)]
    assert max(diffs[:2]) > 1e-4  # long contexts: the codes change the scores
    assert diffs[3] < 1e-4  # a context inside the exact window: nothing compressed, nothing changes


def test_generation_runs_through_the_cache(lm_pair, monkeypatch):
    from lm_eval.api.instance import Instance

    from qjl.integrations.transformers.cache import QJLCache

    lm = _make(lm_pair, "tq-k45v3")
    made = []
    make = lm.make_cache
    monkeypatch.setattr(lm, "make_cache", lambda: made.append(make()) or made[-1])
    reqs = [Instance(request_type="generate_until", doc={}, idx=0,
                     arguments=(CONTEXT, {"until": ["\n\n"], "max_gen_toks": 5, "do_sample": False}))]
    out = lm.generate_until(reqs)
    assert len(out) == 1 and isinstance(out[0], str)
    assert len(made) == 1 and isinstance(made[0], QJLCache)
    assert made[0].get_seq_length() > len(CONTEXT) and made[0].memory_report()["key_code_bytes"] > 0


def test_local_task_end_to_end(lm_pair, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    rows = [{"context": CONTEXT, "question": "What jumps?", "choices": ["the fox", "the dog"], "label": 0,
             "answer": "fox"} for _ in range(3)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tmp_path / "mc.yaml").write_text(
        "task: qjl_local_mc\n" + common + "output_type: multiple_choice\n"
        "doc_to_text: \"{{context}}Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n")
    (tmp_path / "gen.yaml").write_text(
        "task: qjl_local_gen\n" + common + "output_type: generate_until\n"
        "doc_to_text: \"{{context}}Question: {{question}}\\nAnswer:\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    out = lm_eval.simple_evaluate(model=_make(lm_pair, "tq-k3v2"), tasks=["qjl_local_mc", "qjl_local_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path)))
    assert 0.0 <= out["results"]["qjl_local_mc"]["acc,none"] <= 1.0
    assert "exact_match,none" in out["results"]["qjl_local_gen"]


def test_registered_and_arguments_checked():
    from lm_eval.api.registry import get_model

    from qjl.integrations.lm_eval import QJLLM

    assert get_model("qjl") is QJLLM
    with pytest.raises(ValueError, match="chunk"):
        QJLLM(pretrained=None, chunk=0)
    with pytest.raises(ValueError, match="preset"):
        QJLLM(pretrained=None, preset="tq-k9")
    with pytest.raises(ValueError, match="auto-<bits"):
        QJLLM(pretrained=None, preset="auto-three")
    with pytest.raises(TypeError, match="preset"):
        QJLLM(pretrained=None, preset=3.0)


def test_auto_widths_and_configs(lm_pair):
    from qjl import QJLConfig

    lm = _make(lm_pair, "auto-3.0")
    assert lm.qjl_config.allocation is not None and lm.qjl_config.allocation.bits_per_value == 3.0
    got = lm.loglikelihood(_requests(PAIRS[:1]))
    assert len(got) == 1 and got[0][0] < 0
    cfg = QJLConfig.preset("tq-k3v2")
    assert _make(lm_pair, cfg).qjl_config is cfg
    assert _make(lm_pair, cfg, kernel="torch").qjl_config.kernel == "torch"
