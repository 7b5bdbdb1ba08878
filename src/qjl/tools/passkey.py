"""Passkey retrieval: a 5-digit key hidden at several depths of a filler haystack, answered greedily.

The prompt (a chat turn) is about ``n_tokens`` long; the key sits at depth ``(i + 0.5) / trials`` of the
filler for trial ``i``, so the trials cover the start, the middle and the end of the context, and with the
default cache the key's tokens are compressed in every trial but the last ones (which fall in the
exact window).  A trial counts as retrieved when the key appears in the first ``max_new_tokens``
generated tokens.  Keys come from a fixed generator: every method sees the same prompts.
"""

from __future__ import annotations

import torch


from qjl.integrations.transformers.names import cache_kwargs
__all__ = ["passkey_prompts", "passkey_hits", "passkey_hits_by_method", "generate_by_method"]

_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompts(tokenizer, n_tokens: int, trials: int, seed: int = 1234) -> list:
    """``trials`` (input_ids [1, T], key) pairs with T close to ``n_tokens`` (chat template included)."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 64:
        raise ValueError(f"n_tokens must be an int >= 64, got {n_tokens!r}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        raise ValueError(f"trials must be a non-negative int, got {trials!r}")
    g = torch.Generator().manual_seed(seed)
    unit = len(tokenizer(_FILLER).input_ids)
    reps = max(1, (n_tokens - 60) // unit)
    out = []
    for i in range(trials):
        key = str(int(torch.randint(10000, 99999, (1,), generator=g)))
        depth = int(reps * (i + 0.5) / trials)
        body = (_FILLER * depth + f"The pass key is {key}. Remember it. {key} is the pass key. "
                + _FILLER * (reps - depth))
        messages = [{"role": "user", "content": body + "\nWhat is the pass key? Answer with the number only."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append((tokenizer(text, return_tensors="pt").input_ids, key))
    return out


@torch.no_grad()
def passkey_hits(model, tokenizer, prompts: list, make_cache, max_new_tokens: int = 12) -> int:
    """How many of ``prompts`` (from :func:`passkey_prompts`) the model answers with a fresh cache
    from ``make_cache()`` per prompt, greedy decoding."""
    return passkey_hits_by_method(model, tokenizer, prompts, {"method": make_cache}, max_new_tokens)["method"]


@torch.no_grad()
def passkey_hits_by_method(model, tokenizer, prompts: list, makers: dict, max_new_tokens: int = 12,
                           on_prompt=None) -> dict:
    """{name: make_cache} -> {name: hits}: :func:`passkey_hits` for several methods, each prompt prefilled
    once per group of methods whose caches prefill alike (:func:`generate_by_method`).  ``on_prompt()`` (if
    given) is called after each prompt (a progress bar)."""
    hits = dict.fromkeys(makers, 0)
    for ids, key in prompts:
        caches = {name: make() for name, make in makers.items()}
        outs = generate_by_method(model, ids, caches, max_new_tokens, pad_token_id=tokenizer.eos_token_id)
        for name, out in outs.items():
            hits[name] += key in tokenizer.decode(out[0, ids.shape[1]:])
        if on_prompt is not None:
            on_prompt()
    return hits


@torch.no_grad()
def generate_by_method(model, ids: torch.Tensor, caches: dict, max_new_tokens: int, pad_token_id=None) -> dict:
    """Greedy answers to ``ids`` [1, T] with each of ``caches`` ({name: empty cache}) -> {name: [1, T + n] ids},
    each equal, token for token, to ``model.generate(ids, **cache_kwargs(cache), max_new_tokens=max_new_tokens,
    do_sample=False)``.

    One prefill per group of caches that prefill alike (:func:`qjl.tools.methods.prefill_groups`): the group's
    generate stops after the prefill's token (``max_new_tokens=1``), every cache of the group then holds what
    its own prefill would (:func:`qjl.integrations.transformers.prefill.shared_prefill`), and generate goes on
    from the prompt and that token -- a one-token forward on the prefilled cache, as generate's second step is.
    """
    from qjl.integrations.transformers.prefill import shared_prefill
    from qjl.tools.methods import prefill_groups

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, (list, tuple)) else [] if stop is None else [stop])
    gen = dict(do_sample=False, pad_token_id=pad_token_id)
    out = {}
    for names in prefill_groups(model, caches):
        group = [caches[n] for n in names]
        first = shared_prefill(model, group, lambda c: model.generate(ids, **cache_kwargs(c), max_new_tokens=1, **gen))
        for name, cache in zip(names, group):
            out[name] = first
            if max_new_tokens > 1 and int(first[0, -1]) not in stop:
                out[name] = model.generate(first, **cache_kwargs(cache), max_new_tokens=max_new_tokens - 1, **gen)
    return {name: out[name] for name in caches}
