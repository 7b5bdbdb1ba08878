"""``qjl eval``: quality and cost of compressed caches, side by side, on real text.

Protocol (every method sees exactly the same tokens):

1. tokenize a text (:mod:`qjl.tools.texts`), take ``context`` tokens as the prompt and the next
   ``score`` tokens as the scored part;
2. prefill the prompt in one forward pass (exact attention over the prompt; the cache then holds it
   compressed except the sinks and the recent window); methods whose prefill computes the same (the same
   exact storage dtype and key smoothing, :mod:`qjl.integrations.transformers.prefill`) share one forward;
3. feed the scored tokens in chunks of ``chunk`` tokens; each chunk attends to the compressed history +
   exact window + itself, and yields next-token distributions;
4. against the full-precision cache (``DynamicCache``) run the same way: mean KL(p_full || p_method) in
   nats, top-1 agreement, perplexity of the true tokens (and its change in percent);
5. passkey retrieval (:mod:`qjl.tools.passkey`) at one or more prompt lengths.

Memory: the bytes a cache holds after scoring (``cache_memory``: storage actually held, codes and exact
tokens apart) and at ``memory_tokens`` tokens (a prefill of that length plus one decode step; the keys and
values fed are real ones, repeated to that length, as the bytes depend on the token count, not the values).
Results of one run go to a run directory as ``config.json`` + ``metrics.json`` (:mod:`qjl.tools.evalrun`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from qjl.integrations.transformers.layer import QJLCacheLayer
from qjl.integrations.transformers.names import cache_kwargs
from qjl.tools.methods import cache_memory, make_cache, prefill_groups

__all__ = ["EvalSetup", "load_text_ids", "prefill_methods", "score_prefilled", "score_method", "quality", "measure",
           "evaluate_method", "block_standard_error", "token_quality", "summarize_tokens", "measure_tokens", "SE_BLOCK",
           "capture_kv", "held_kv", "tile_kv", "memory_at", "DEFAULT_TEXT"]

DEFAULT_TEXT = "gpl-3"


@dataclass(frozen=True)
class EvalSetup:
    """One scoring protocol: ``context`` prompt tokens, then ``score`` tokens in chunks of ``chunk``."""

    context: int = 1536
    score: int = 512
    chunk: int = 32

    def __post_init__(self):
        for name in ("context", "score", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def tokens(self) -> int:
        """Tokens of text one evaluation reads (prompt + scored)."""
        return self.context + self.score


def load_text_ids(tokenizer, text: str, n_tokens: int) -> tuple:
    """The first ``n_tokens`` token ids of a corpus text or file -> (ids [n_tokens], meta dict).

    Only a prefix of a long text is tokenized (enough characters for the tokens asked, with margin), so
    the ids do not depend on how much of the text lies beyond.  Raises ValueError if the text is short.
    """
    from qjl.tools.texts import load_text

    full, meta = load_text(text)
    cut = 8 * n_tokens
    while True:
        ids = tokenizer(full[:cut], return_tensors="pt").input_ids[0]
        if ids.numel() >= n_tokens + 64 or cut >= len(full):
            break
        cut *= 2
    meta["tokens"] = int(tokenizer(full, return_tensors="pt").input_ids.shape[1]) if cut >= len(full) else None
    if ids.numel() < n_tokens:
        raise ValueError(f"text {text!r} has {ids.numel()} tokens; this evaluation needs {n_tokens}")
    return ids[:n_tokens], meta


@torch.no_grad()
def prefill_methods(model, prompt: torch.Tensor, cfgs: dict):
    """Prefill ``prompt`` ([T] token ids) into a fresh cache per configuration (``cfgs``: name -> cfg, None for
    full precision), one forward per group of configurations that prefill alike
    (:func:`qjl.tools.methods.prefill_groups`; each cache ends as its own prefill would leave it, bit for bit).

    Yields (name, cache, log-probs of the next token [1, V] float32), group after group.
    """
    from qjl.integrations.transformers.prefill import shared_prefill

    caches = {name: make_cache(model, cfg) for name, cfg in cfgs.items()}
    for names in prefill_groups(model, caches):
        group = [caches.pop(n) for n in names]
        out = shared_prefill(model, group, lambda c: model(prompt.unsqueeze(0), **cache_kwargs(c), use_cache=True))
        logp = torch.log_softmax(out.logits[0, -1:].float(), dim=-1)
        del out
        for name, cache in zip(names, group):
            yield name, cache, logp
        del group


@torch.no_grad()
def score_prefilled(model, ids: torch.Tensor, setup: EvalSetup, cache, first: torch.Tensor) -> tuple:
    """Score ``ids[context:context + score]`` in chunks on a cache that holds the prefilled ``ids[:context]``;
    ``first``: the prefill's log-probs of the next token [1, V].  -> (log-probs [score, V], seconds of the chunks)."""
    if ids.numel() < setup.tokens:
        raise ValueError(f"ids holds {ids.numel()} tokens; the setup needs {setup.tokens}")
    if cache.get_seq_length() != setup.context:
        raise ValueError(f"cache holds {cache.get_seq_length()} tokens; the setup's context is {setup.context}")
    logps = [first]
    scored = ids[setup.context: setup.tokens]
    t0 = time.perf_counter()
    for start in range(0, setup.score - 1, setup.chunk):
        piece = scored[start: min(start + setup.chunk, setup.score - 1)].unsqueeze(0)
        out = model(piece, **cache_kwargs(cache), use_cache=True)
        logps.append(torch.log_softmax(out.logits[0].float(), dim=-1))
    return torch.cat(logps)[: setup.score], time.perf_counter() - t0


@torch.no_grad()
def score_method(model, ids: torch.Tensor, setup: EvalSetup, cfg) -> tuple:
    """Prefill ``ids[:context]``, then score the next ``score`` tokens in chunks.

    ids: [>= setup.tokens] token ids.  -> (log-probs [score, V] float32, the cache, seconds of the chunks).
    """
    if ids.numel() < setup.tokens:
        raise ValueError(f"ids holds {ids.numel()} tokens; the setup needs {setup.tokens}")
    ((_, cache, first),) = prefill_methods(model, ids[: setup.context], {"method": cfg})
    logp, secs = score_prefilled(model, ids, setup, cache, first)
    return logp, cache, secs


SE_BLOCK = 16  # tokens per block of the perplexity change's standard error (neighbouring tokens correlate)


def block_standard_error(x: torch.Tensor, block: int = SE_BLOCK) -> float:
    """Standard error of ``x.mean()`` (x: [n]) from the means of consecutive blocks of ``block`` values
    (batch means: errors of neighbouring tokens correlate, so per-token variance would understate it); the tail
    that fills no block is dropped from the blocks only.  NaN when fewer than two blocks fit."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"x must be 1-d, got shape {tuple(x.shape)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    nb = x.numel() // block
    if nb < 2:
        return float("nan")
    means = x[: nb * block].double().view(nb, block).mean(1)
    return (means.std() / math.sqrt(nb)).item()


def token_quality(logp: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor | None = None) -> dict:
    """logp, reference: [n, V] log-probs; targets: [n] true next tokens -> per-token columns [n] (logp's dtype): ``nll``
    and, against ``reference``, ``kl`` (KL(ref || logp), nats), ``top1`` (1.0 where the argmaxes agree) and
    ``ref_nll`` -- what :func:`summarize_tokens` averages, and what segments of one text concatenate."""
    if logp.dim() != 2 or targets.dim() != 1:
        raise ValueError(f"logp must be [n, V] and targets [n], got {tuple(logp.shape)} and {tuple(targets.shape)}")
    if logp.shape[0] != targets.shape[0]:
        raise ValueError(f"logp has {logp.shape[0]} rows, targets {targets.shape[0]}")
    cols = {"nll": -logp.gather(1, targets.unsqueeze(1))[:, 0]}
    if reference is not None:
        if reference.shape != logp.shape:
            raise ValueError(f"reference has shape {tuple(reference.shape)}, logp {tuple(logp.shape)}")
        cols["kl"] = (reference.exp() * (reference - logp)).sum(-1)
        cols["top1"] = (reference.argmax(-1) == logp.argmax(-1)).float()
        cols["ref_nll"] = -reference.gather(1, targets.unsqueeze(1))[:, 0]
    return cols


def summarize_tokens(cols: dict) -> dict:
    """Per-token columns of :func:`token_quality` (one segment's, or several segments' concatenated) -> {ppl, nll}
    and, where a reference was given, {kl, top1, dnll_se}: means over the tokens, and the standard error of the mean
    NLL change (blocks of :data:`SE_BLOCK` tokens, :func:`block_standard_error`; segments of a multiple of the block
    concatenate into whole blocks)."""
    if not isinstance(cols, dict) or "nll" not in cols:
        raise ValueError(f"cols must be token_quality's columns (a dict with 'nll'), got {type(cols).__name__}")
    if "kl" in cols and not {"top1", "ref_nll"} <= cols.keys():
        raise ValueError(f"cols has 'kl' but not 'top1' and 'ref_nll': {sorted(cols)}")
    n = cols["nll"].numel()
    if n == 0:
        raise ValueError("cols: no scored tokens")
    if any(c.shape != (n,) for c in cols.values()):
        raise ValueError(f"columns of unequal shapes: { {k: tuple(c.shape) for k, c in cols.items()} }")
    nll = cols["nll"].mean().item()
    m = {"nll": nll, "ppl": math.exp(nll)}
    if "kl" in cols:
        m["kl"] = cols["kl"].mean().item()
        m["top1"] = cols["top1"].mean().item()
        m["dnll_se"] = block_standard_error(cols["nll"] - cols["ref_nll"])
    return m


def quality(logp: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor | None = None) -> dict:
    """logp, reference: [n, V] log-probs; targets: [n] true next tokens.

    -> {ppl, nll} and, against ``reference``: {kl (mean KL(ref || logp), nats), top1 (argmax agreement),
    dnll_se (standard error, in nats, of the mean per-token NLL change against ``reference``: the paired
    difference, blocks of :data:`SE_BLOCK` tokens, :func:`block_standard_error`)}.  The perplexity change's
    standard error in percent is ``100 * ppl / ppl_ref * dnll_se`` (first order).
    """
    return summarize_tokens(token_quality(logp, targets, reference))


def evaluate_method(model, ids: torch.Tensor, setup: EvalSetup, cfg, reference: torch.Tensor | None = None) -> tuple:
    """:func:`score_method` + :func:`quality` + the bytes held after scoring -> (metrics, log-probs [score, V])."""
    logp, cache, secs = score_method(model, ids, setup, cfg)
    return measure(logp, cache, secs, ids, setup, reference), logp


def measure(logp: torch.Tensor, cache, secs: float, ids: torch.Tensor, setup: EvalSetup,
            reference: torch.Tensor | None = None) -> dict:
    """Metrics of one scored method: :func:`quality` of ``logp`` [score, V] against ``reference``, the scoring
    speed and the bytes ``cache`` holds after scoring."""
    return measure_tokens(token_quality(logp, ids[setup.context: setup.tokens], reference), cache, secs,
                          setup.score - 1)


def measure_tokens(cols: dict, cache, secs: float, fed: int) -> dict:
    """:func:`summarize_tokens` of ``cols`` (per-token columns, one or several segments), ``fed`` tokens fed in
    ``secs`` seconds of scoring, and the bytes ``cache`` (the last segment's) holds after scoring."""
    if isinstance(fed, bool) or not isinstance(fed, int) or fed < 0:
        raise ValueError(f"fed must be a non-negative int, got {fed!r}")
    m = summarize_tokens(cols)
    m.update(tokens_per_s=fed / secs if secs > 0 else float("nan"), cache=cache_memory(cache))
    m["compressed_bits"] = m["cache"]["compressed_bits"]
    return m


@torch.no_grad()
def capture_kv(model, ids: torch.Tensor, tokens: int) -> list:
    """Keys and values of ``tokens`` tokens (``ids`` repeated if short), one full-precision prefill
    -> [(keys, values)] per layer, each ``[1, H_kv, tokens, D]``."""
    reps = -(-tokens // ids.numel())
    cache = make_cache(model, None)
    model(ids.repeat(reps)[:tokens].unsqueeze(0), **cache_kwargs(cache), use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def held_kv(cache) -> list:
    """The keys and values a full-precision cache (``DynamicCache``) holds -> [(keys, values)] per layer,
    each ``[B, H_kv, n, D]``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def tile_kv(kv: list, tokens: int) -> list:
    """[(keys, values)] per layer, each ``[B, H_kv, n, D]`` -> the same repeated along the tokens and cut to
    exactly ``tokens`` (for :func:`memory_at`, whose bytes depend on the token count, not on the values)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if not kv or kv[0][0].shape[-2] == 0:
        raise ValueError("kv must hold at least one token")
    reps = -(-tokens // kv[0][0].shape[-2])
    return [(k.repeat(1, 1, reps, 1)[..., :tokens, :], v.repeat(1, 1, reps, 1)[..., :tokens, :]) for k, v in kv]


@torch.no_grad()
def memory_at(model, ids: torch.Tensor, cfg, tokens: int, kv: list | None = None) -> dict:
    """Bytes a cache holds for ``tokens`` tokens: a prefill of ``tokens - 1`` tokens, then one decode step
    (which moves the prompt's overflow into codes) -> :func:`qjl.tools.methods.cache_memory`.

    With ``kv`` (from :func:`capture_kv`, or :func:`tile_kv` of a full-precision cache's :func:`held_kv`) the
    cache receives those keys and values through its own ``update`` in the same two steps, without running
    the model again: the same tensors held, as a cache's bytes depend on its configuration and the token
    count, not on the values.  Its compressed layers take the prefill's attention step with the prompt's keys
    standing in for its queries (value smoothing and heavy tokens are fitted there: which tokens are heavy
    depends on the queries, how many does not).  Configurations that choose widths from the prompt's queries
    need the model run (``kv=None``).
    """
    cache = make_cache(model, cfg)
    if kv is None:
        reps = -(-tokens // ids.numel())
        x = ids.repeat(reps)[:tokens].unsqueeze(0)
        model(x[:, :-1], **cache_kwargs(cache), use_cache=True)
        model(x[:, -1:], **cache_kwargs(cache), use_cache=True)
    else:
        if kv[0][0].shape[-2] != tokens:
            raise ValueError(f"kv holds {kv[0][0].shape[-2]} tokens, not {tokens}")
        for step, part in enumerate((slice(0, tokens - 1), slice(tokens - 1, tokens))):
            for i, (k, v) in enumerate(kv):
                cache.update(k[..., part, :], v[..., part, :], i)
                layer = cache.layers[i]
                if step == 0 and isinstance(layer, QJLCacheLayer):  # the prefill's attention step
                    layer.store.before_attention(None, k[..., part, :].float(), k.shape[-1] ** -0.5)
    return {"tokens": tokens, **cache_memory(cache)}
