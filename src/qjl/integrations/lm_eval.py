"""lm-evaluation-harness: the model ``qjl``, an ``HFLM`` whose every request runs through a compressed cache.

lm-eval's ``HFLM`` scores a (context, continuation) pair with ONE forward pass over context + continuation
and no cache, so a loglikelihood task never touches a KV cache and would report "unchanged accuracy" for any
cache.  Here, per request:

* **loglikelihood**: the context is prefilled into a fresh cache (``QJLCache`` with the chosen preset), then
  the continuation is teacher-forced against it in chunks of ``chunk`` tokens: every continuation token
  attends to the compressed context (+ sinks + exact window) and, exactly, to the continuation tokens of its
  own chunk.  Requests that share a context reuse one prefill (the cache is copied per continuation).
  ``loglikelihood_rolling`` (perplexity tasks) goes through the same path: long documents are scored in
  chunks against the compressed earlier text.
* **generate_until**: ``model.generate`` with a fresh cache per batch (prefill, then decoding steps over it).

``preset="none"`` runs the same path with transformers' ``DynamicCache`` (the full-precision reference, so a
difference between the two is the cache's alone).

Use (lm-eval >= 0.4.13; see docs/quality.md)::

    qjl-lm-eval --model qjl --model_args preset=tq-k3v2 --tasks hellaswag --device cpu
    # or: python -m qjl.integrations.lm_eval ... ; or from Python:
    import lm_eval, qjl.integrations.lm_eval
    lm_eval.simple_evaluate(model="qjl", model_args="pretrained=smollm2,preset=tq-k45v3", tasks=[...])

``pretrained`` is ``smollm2`` (the embedded model, the default), a local model directory or a .gguf file.
Importing this module registers the model name ``qjl`` with lm-eval (it imports lm-eval).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import replace

import torch


from qjl.integrations.transformers.names import cache_arg, cache_kwargs
try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("qjl's lm-eval model needs lm-evaluation-harness: pip install 'qjl[lm-eval]'") from e

__all__ = ["QJLLM", "main"]


@register_model("qjl")
class QJLLM(HFLM):
    """``HFLM`` with a compressed KV cache in every request (see the module docstring).

    Args:
        pretrained: "smollm2" (the embedded model), a model directory, a .gguf file, or a loaded
            transformers model (then ``tokenizer`` is required).
        preset: a :data:`qjl.PRESETS` name (default: :data:`qjl.DEFAULT_PRESET`), "auto-<bits>", "none"
            (``DynamicCache``), or a :class:`qjl.QJLConfig` (from Python).
        chunk: continuation tokens per forward pass while teacher-forcing (>= 1).
        kernel: passed to the preset (``QJLConfig.kernel``): "auto", "cpu", "triton" or "torch".
        **kwargs: ``HFLM`` arguments (``tokenizer``, ``max_length``, ``batch_size`` for generation, ...).
    """

    def __init__(self, pretrained="smollm2", preset: str | None = None, chunk: int = 32, kernel: str = "auto",
                 **kwargs):
        from qjl.cache.config import QJLConfig
        from qjl.cache.presets import DEFAULT_PRESET

        chunk = int(chunk)
        if chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        preset = preset or DEFAULT_PRESET
        if isinstance(preset, QJLConfig):
            self.qjl_config = preset if kernel == "auto" else replace(preset, kernel=kernel)
        elif isinstance(preset, str):
            try:
                self.qjl_config = None if preset == "none" else QJLConfig.named(preset, kernel=kernel)
            except ValueError as e:
                raise ValueError(f"preset: {e}") from None
        else:
            raise TypeError(f"preset must be a preset name or a qjl.QJLConfig, got {type(preset).__name__}")
        self.preset, self.chunk = preset, chunk
        if isinstance(pretrained, str):
            from qjl.tools.models import check_model_name, load_model

            check_model_name(pretrained)
            model, tok = load_model(pretrained)
            kwargs.setdefault("tokenizer", tok)
            kwargs.pop("device", None)  # the model is loaded on the CPU; HFLM takes its device from the model
            pretrained = model
        from qjl.integrations.transformers.attention import patch_attention

        patch_attention(pretrained)
        super().__init__(pretrained=pretrained, **kwargs)

    # -- caches ---------------------------------------------------------------------------------------------
    def make_cache(self):
        """A fresh cache for one request: ``QJLCache`` with the preset, or ``DynamicCache`` for "none"."""
        from transformers import DynamicCache

        from qjl.integrations.transformers.cache import QJLCache

        if self.qjl_config is None:
            return DynamicCache(config=self.model.config)
        return QJLCache(self.model, self.qjl_config)

    @torch.no_grad()
    def _prefill(self, context: list):
        """context: token ids -> (cache holding them, log-probs [V] of the next token).

        The prompt's overflow is moved into codes here, as the next forward would do first, so the copies
        made per continuation share those codes instead of each quantizing the context again."""
        cache = self.make_cache()
        out = self.model(torch.tensor([context], device=self.device), **cache_kwargs(cache), use_cache=True)
        for layer in cache.layers:
            store = getattr(layer, "store", None)  # compressed layers (QJLCacheLayer)
            if store is not None:
                store.flush()
        return cache, torch.log_softmax(out.logits[0, -1].float(), dim=-1)

    @torch.no_grad()
    def _continue(self, cache, first: torch.Tensor, continuation: list) -> tuple:
        """Teacher-force ``continuation`` after a prefilled cache -> (sum of log-probs, greedy match)."""
        logps = [first.unsqueeze(0)]
        feed = continuation[:-1]
        for start in range(0, len(feed), self.chunk):
            piece = torch.tensor([feed[start: start + self.chunk]], device=self.device)
            logits = self.model(piece, **cache_kwargs(cache), use_cache=True).logits[0]
            logps.append(torch.log_softmax(logits.float(), dim=-1))
        logp = torch.cat(logps)  # [len(continuation), V]
        target = torch.tensor(continuation, device=logp.device)
        total = logp.gather(1, target.unsqueeze(1)).sum().item()
        return total, bool((logp.argmax(-1) == target).all())

    # -- lm-eval entry points -------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """requests: [((context str, continuation str), context ids, continuation ids)] -> [(logprob, greedy)]."""
        from tqdm import tqdm

        order = sorted(range(len(requests)), key=lambda i: (tuple(requests[i][1]), i))
        results, last_ctx, prefilled = [None] * len(requests), None, None
        for i in tqdm(order, disable=disable_tqdm or self.rank != 0, desc="qjl loglikelihood"):
            cache_key, context, continuation = requests[i]
            if not continuation:
                raise ValueError("loglikelihood: an empty continuation has no likelihood to score")
            window = (list(context) + list(continuation))[-(self.max_length + 1):][:-1]
            context = window[: len(window) - len(continuation) + 1]
            if context != last_ctx:
                prefilled, last_ctx = self._prefill(context), context
            cache, first = prefilled
            answer = self._continue(copy.deepcopy(cache), first, list(continuation))
            results[i] = answer
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return results

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        generation_kwargs.setdefault(cache_arg(), self.make_cache())
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def main(argv=None) -> None:
    """lm-eval's command line with the model ``qjl`` registered (``qjl-lm-eval ...``)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
