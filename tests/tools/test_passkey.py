"""Passkey retrieval: prompts, and answers through a shared prefill that equal generate's token for token."""

import pytest
import torch

from qjl.tools import passkey
from qjl.tools.methods import has_quanto, make_cache, make_method
from qjl.integrations.transformers.names import cache_kwargs

torch.set_grad_enabled(False)

METHODS = ["full precision", "tq-k45v3", "tq-k3v2", "qjl-paper", "kivi-k2v2"] + (["hf-quanto-k4v4"] if has_quanto()
                                                                                  else [])


@pytest.fixture(scope="module")
def lm():
    import qjl
    from byte_lm import byte_llama, byte_tokenizer

    model, tok = byte_llama(), byte_tokenizer()
    qjl.patch_attention(model)
    return model, tok


def _generate(model, tok, ids, name, n):
    return model.generate(ids, **cache_kwargs(make_cache(model, make_method(name))), max_new_tokens=n,
                          do_sample=False, pad_token_id=tok.eos_token_id)


def test_prompts_hide_the_key_at_every_depth(lm):
    _, tok = lm
    prompts = passkey.passkey_prompts(tok, 900, 3)
    assert len(prompts) == 3 and len({k for _, k in prompts}) == 3
    texts = [tok.decode(ids[0]) for ids, _ in prompts]
    depths = [t.index(f"pass key is {k}") / len(t) for t, (_, k) in zip(texts, prompts)]
    assert depths[0] < 0.25 < depths[1] < 0.6 < depths[2]
    assert all(abs(ids.shape[1] - 900) < 120 for ids, _ in prompts)
    with pytest.raises(ValueError, match="n_tokens"):
        passkey.passkey_prompts(tok, 10, 3)


def test_answers_through_a_shared_prefill_equal_generate(lm):
    """Every method's answer equals its own ``model.generate`` token for token, with a prompt long enough to be
    compressed during the prefill (720 > 128 + 32 + 512 tokens)."""
    model, tok = lm
    ids = passkey.passkey_prompts(tok, 720, 1)[0][0]
    outs = passkey.generate_by_method(model, ids, {n: make_cache(model, make_method(n)) for n in METHODS}, 6,
                                      pad_token_id=tok.eos_token_id)
    assert list(outs) == METHODS
    for name in METHODS:
        assert torch.equal(outs[name], _generate(model, tok, ids, name, 6)), name
    assert outs["full precision"].shape[1] == ids.shape[1] + 6


def test_an_answer_that_ends_at_once_stops_as_generate_does(lm):
    model, tok = lm
    ids = passkey.passkey_prompts(tok, 200, 1)[0][0]
    first = int(_generate(model, tok, ids, "full precision", 1)[0, -1])
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = first  # the first answer token ends the answer
    try:
        outs = passkey.generate_by_method(model, ids, {n: make_cache(model, make_method(n)) for n in METHODS[:3]}, 5,
                                          pad_token_id=tok.eos_token_id)
        for name, out in outs.items():
            assert torch.equal(out, _generate(model, tok, ids, name, 5)), name
    finally:
        model.generation_config.eos_token_id = eos
    with pytest.raises(ValueError, match="max_new_tokens"):
        passkey.generate_by_method(model, ids, {}, 0)


def test_hits_by_method_equal_hits_one_method_at_a_time(lm):
    model, tok = lm
    prompts = passkey.passkey_prompts(tok, 300, 2)
    makers = {n: (lambda n=n: make_cache(model, make_method(n))) for n in METHODS[:3]}
    hits = passkey.passkey_hits_by_method(model, tok, prompts, makers, max_new_tokens=4)
    for name, make in makers.items():
        alone = sum(key in tok.decode(_generate(model, tok, ids, name, 4)[0, ids.shape[1]:]) for ids, key in prompts)
        assert hits[name] == alone == passkey.passkey_hits(model, tok, prompts, make, max_new_tokens=4)
