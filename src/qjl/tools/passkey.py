"""Passkey retrieval: a 5-digit key hidden at several depths of a filler haystack, answered greedily.

The prompt (a chat turn) is about ``n_tokens`` long; the key sits at depth ``(i + 0.5) / trials`` of the
filler for trial ``i``, so the trials cover the start, the middle and the end of the context, and with the
default cache the key's tokens are compressed in every trial but the last ones (which fall in the
exact window).  A trial counts as retrieved when the key appears in the first ``max_new_tokens``
generated tokens.  Keys come from a fixed generator: every method sees the same prompts.
"""

from __future__ import annotations

import torch

__all__ = ["passkey_prompts", "passkey_hits"]

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
    hits = 0
    for ids, key in prompts:
        out = model.generate(ids, past_key_values=make_cache(), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        hits += key in tokenizer.decode(out[0, ids.shape[1]:])
    return hits
