"""``qjl eval``: quality and cost of compressed caches, side by side, on real text.

Protocol (every method sees exactly the same tokens):

1. tokenize ``text`` (default: the GPL-3 text every Debian machine has), take
   ``context`` tokens as the prompt and the next ``score`` tokens as the scored part;
2. prefill the prompt in one forward pass (exact attention over the prompt, then the
   cache compresses everything but the recent window);
3. feed the scored tokens in chunks of ``chunk`` tokens; each chunk attends to the
   compressed history + exact window + itself, and yields next-token distributions;
4. against the full-precision cache (``DynamicCache``) run the same way: mean
   KL(p_full || p_method) in nats, top-1 agreement, perplexity of the true tokens;
5. passkey retrieval: a ~1k-token haystack with a 5-digit key at several depths,
   greedy answer, counted correct if the key appears in it.

Cache bytes come from the tensors held (``QJLCache.memory_report``), bits per value
split into keys / values (the compressed part) and the exact window.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass

import torch

from qjl.cache.config import QJLConfig
from qjl.cache.presets import PRESETS

__all__ = ["EvalSetup", "default_methods", "evaluate_method", "passkey_prompts", "load_text_ids"]

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


@dataclass(frozen=True)
class EvalSetup:
    context: int = 1536
    score: int = 512
    chunk: int = 32
    passkey_tokens: int = 1024
    passkey_trials: int = 5

    def __post_init__(self):
        for name in ("context", "score", "chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.passkey_trials < 0 or self.passkey_tokens < 64:
            raise ValueError("passkey_trials must be >= 0 and passkey_tokens >= 64")


@dataclass(frozen=True)
class HFQuantized:
    """transformers' own ``QuantizedCache`` (KIVI-like, per-channel groups), run as a peer."""

    backend: str = "quanto"
    nbits: int = 4
    q_group_size: int = 64
    residual_length: int = 128

    def make(self, model):
        from transformers import QuantizedCache

        return QuantizedCache(self.backend, model.config, nbits=self.nbits, q_group_size=self.q_group_size,
                              residual_length=self.residual_length)

    def describe(self, head_dim=None, num_layers=None) -> str:
        return (f"transformers QuantizedCache({self.backend}, nbits={self.nbits}, q_group_size={self.q_group_size}, "
                f"residual_length={self.residual_length})")


def hf_quantized_available(backend: str = "quanto") -> bool:
    import importlib.util

    return importlib.util.find_spec("optimum.quanto" if backend == "quanto" else "hqq") is not None


def default_methods() -> dict:
    """label -> QJLConfig (None = the full-precision DynamicCache; HFQuantized = transformers' peer)."""
    methods = {"full precision": None}
    methods.update({name: cfg for name, cfg in PRESETS.items()})
    if hf_quantized_available():
        methods["hf-quanto-k4v4"] = HFQuantized(nbits=4)
        methods["hf-quanto-k2v2"] = HFQuantized(nbits=2)
    return methods


def held_bytes(obj) -> int:
    """Bytes of a tensor, looking inside tensor subclasses (quanto's packed tensors) for what is really stored."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(held_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    return 0


def load_text_ids(tokenizer, path: str, n_tokens: int) -> torch.Tensor:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < n_tokens:
        raise ValueError(f"text {path} has {ids.numel()} tokens; context + score needs {n_tokens}")
    return ids[:n_tokens]


def _make_cache(model, cfg):
    from transformers import DynamicCache

    from qjl.integrations.transformers.cache import QJLCache

    if cfg is None:
        return DynamicCache(config=model.config)
    if isinstance(cfg, HFQuantized):
        return cfg.make(model)
    return QJLCache(model, cfg)


def _hf_memory(cache) -> dict:
    """Bytes held by a transformers cache, split into quantized and original-precision parts."""
    quant = exact = q_coords = e_coords = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values"):
            t = getattr(layer, name, None)
            if t is not None:
                quant += held_bytes(t)
                q_coords += t.numel()
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                exact += held_bytes(t)
                e_coords += t.numel()
    return {"bytes": quant + exact, "fp16_bytes": 2 * (q_coords + e_coords),
            "compressed_bits": 8 * quant / q_coords if q_coords else 0.0}


@torch.no_grad()
def _score(model, ids: torch.Tensor, setup: EvalSetup, cfg):
    """-> (log-probs [score, V] float32, cache, seconds for the scored chunks)."""
    cache = _make_cache(model, cfg)
    ctx = ids[: setup.context].unsqueeze(0)
    out = model(ctx, past_key_values=cache, use_cache=True)
    logps = [torch.log_softmax(out.logits[0, -1:].float(), dim=-1)]
    scored = ids[setup.context: setup.context + setup.score]
    t0 = time.perf_counter()
    for start in range(0, setup.score - 1, setup.chunk):
        piece = scored[start: min(start + setup.chunk, setup.score - 1)].unsqueeze(0)
        out = model(piece, past_key_values=cache, use_cache=True)
        logps.append(torch.log_softmax(out.logits[0].float(), dim=-1))
    return torch.cat(logps)[: setup.score], cache, time.perf_counter() - t0


def passkey_prompts(tokenizer, n_tokens: int, trials: int) -> list:
    """(input_ids, key) pairs: filler with 'The pass key is NNNNN.' at depths spread over the text."""
    filler = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
    out = []
    g = torch.Generator().manual_seed(1234)
    unit = len(tokenizer(filler).input_ids)
    reps = max(1, (n_tokens - 60) // unit)
    for i in range(trials):
        key = str(int(torch.randint(10000, 99999, (1,), generator=g)))
        depth = int(reps * (i + 0.5) / max(trials, 1))
        body = filler * depth + f"The pass key is {key}. Remember it. {key} is the pass key. " + filler * (reps - depth)
        messages = [{"role": "user", "content": body + "\nWhat is the pass key? Answer with the number only."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append((tokenizer(text, return_tensors="pt").input_ids, key))
    return out


@torch.no_grad()
def _passkey(model, tokenizer, prompts, cfg) -> int:
    hits = 0
    for ids, key in prompts:
        cache = _make_cache(model, cfg)
        gen = model.generate(ids, past_key_values=cache, max_new_tokens=16, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        hits += key in tokenizer.decode(gen[0, ids.shape[1]:])
    return hits


def evaluate_method(model, tokenizer, ids, setup: EvalSetup, cfg, reference=None, prompts=None) -> tuple:
    """Run one method; returns (metrics dict, its log-probs for use as a reference)."""
    logp, cache, secs = _score(model, ids, setup, cfg)
    targets = ids[setup.context: setup.context + setup.score]  # logp[i] predicts token context + i
    n = min(len(targets), logp.shape[0])
    nll = -logp[:n].gather(1, targets[:n].unsqueeze(1)).mean().item()
    m = {"ppl": math.exp(nll), "tokens_per_s": (setup.score - 1) / secs if secs > 0 else float("nan"),
         "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if reference is not None:
        kl = (reference.exp() * (reference - logp)).sum(-1)
        m["kl"] = kl.mean().item()
        m["top1"] = (reference.argmax(-1) == logp.argmax(-1)).float().mean().item()
    if isinstance(cfg, HFQuantized):
        r = _hf_memory(cache)
        m.update(cache_bytes=r["bytes"], fp16_bytes=r["fp16_bytes"], key_bits=r["compressed_bits"],
                 value_bits=r["compressed_bits"], compressed_bits=r["compressed_bits"],
                 bits_per_value=8 * r["bytes"] / r["fp16_bytes"] * 2, config=cfg.describe())
    elif cfg is None:
        layers = [layer for layer in cache.layers if layer.keys is not None]
        nbytes = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        coords = sum(layer.keys.numel() for layer in layers)
        m.update(cache_bytes=nbytes, fp16_bytes=4 * coords, key_bits=16.0, value_bits=16.0,
                 bits_per_value=8 * nbytes / (2 * coords))
    else:
        r = cache.memory_report()
        m.update(cache_bytes=r["bytes"], fp16_bytes=r["fp16_bytes"], key_bits=r["key_bits"],
                 value_bits=r["value_bits"], bits_per_value=r["bits_per_value"],
                 compressed_bits=(r["key_bits"] + r["value_bits"]) / 2)
        m["config"] = cfg.describe(model.config.head_dim if getattr(model.config, "head_dim", None)
                                   else model.config.hidden_size // model.config.num_attention_heads,
                                   model.config.num_hidden_layers)
    if prompts:
        m["passkey"] = _passkey(model, tokenizer, prompts, cfg)
        m["passkey_trials"] = len(prompts)
    return m, logp


def quality_vs_bits_plot(results: dict, path) -> None:
    """KL and perplexity against compressed bits per value, one line per key codec."""
    from qjl.tools.report import save_figure, two_panels

    fig, (ax1, ax2) = two_panels()
    families = {}
    for label, m in results.items():
        if "compressed_bits" in m:
            families.setdefault(label.rsplit("-", 1)[0], []).append((m["compressed_bits"], m["kl"], m["ppl"], label))
    for fam, pts in sorted(families.items()):
        pts.sort()
        ax1.plot([p[0] for p in pts], [max(p[1], 1e-5) for p in pts], "o-", label=fam)
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=fam)
    if "full precision" in results:
        ax2.axhline(results["full precision"]["ppl"], color="k", ls="--", label="full precision")
    ax1.set(xlabel="bits per value (keys+values, compressed part)", ylabel="mean KL vs full precision (nats)",
            yscale="log", title="next-token KL")
    ax2.set(xlabel="bits per value (keys+values, compressed part)", ylabel="perplexity", yscale="log",
            title="perplexity")
    save_figure(fig, (ax1, ax2), path)


def check_config_for_model(cfg, model) -> None:
    """Fail early, before a long run, if a configuration cannot serve this model."""
    if isinstance(cfg, QJLConfig):
        d = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
        cfg.bits_per_value(d)


@torch.no_grad()
def memory_at(model, ids: torch.Tensor, cfg, tokens: int) -> dict:
    """Prefill ``tokens`` tokens (the text repeated if short), then one decode step: bytes held vs fp16."""
    reps = -(-tokens // ids.numel())
    x = ids.repeat(reps)[:tokens].unsqueeze(0)
    cache = _make_cache(model, cfg)
    model(x, past_key_values=cache, use_cache=True)
    model(x[:, -1:], past_key_values=cache, use_cache=True)  # moves the prompt's overflow into codes
    if isinstance(cfg, HFQuantized):
        r = _hf_memory(cache)
    elif cfg is None:
        nbytes = sum(held_bytes(t) for layer in cache.layers for t in (layer.keys, layer.values))
        r = {"bytes": nbytes, "fp16_bytes": sum(2 * layer.keys.numel() * 2 for layer in cache.layers)}
    else:
        r = cache.memory_report()
    return {"bytes": r["bytes"], "fp16_bytes": r["fp16_bytes"], "x_vs_fp16": r["fp16_bytes"] / r["bytes"],
            "bits_per_value": 16 * r["bytes"] / r["fp16_bytes"]}
