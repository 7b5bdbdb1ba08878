"""The cache methods ``qjl eval`` compares, by name: full precision, every preset, transformers' peer.

* ``"full precision"`` -- transformers' ``DynamicCache`` at the model's dtype: the reference every
  other method is measured against (always run);
* every name in :data:`qjl.PRESETS` -- a :class:`qjl.QJLCache` with that preset;
* ``"auto-<bits>"`` (e.g. ``auto-3.0``) -- ``QJLConfig.auto(bits_per_value=<bits>)``, where this version
  of the cache has it: codec widths chosen per KV head of each layer from the prompt; ``"auto-<bits>c<K>"`` (e.g.
  ``auto-3.0c1``): its value candidates over K rotations in turn (AutoBits ``value_cycles``; default 8); a final
  ``l`` (``auto-3.0l``): widths per layer (AutoBits ``per_head=False``); a last ``u`` (``auto-3.0u``): layers'
  errors unweighted by the residual stream (AutoBits ``residual_weights=False``);
* ``"hf-quanto-k4v4"``, ``"hf-quanto-k2v2"`` -- transformers' own ``QuantizedCache`` (quanto backend,
  per-channel groups of 64, residual 128), with ``pip install optimum-quanto``;
* ``"<preset or auto-bits>@<seed>"`` (e.g. ``tq-k3v3@2``) -- the same configuration with another base seed
  (``QJLConfig.seed``: every rotation and sketch drawn anew).  The rotations are random draws: at 3 bits two
  seeds of one preset can differ in KL by a third on one text, so comparisons near each other are made over
  several seeds (``qjl eval --seeds N``).

:func:`resolve_methods` checks names before any model loads; :func:`cache_memory` reports what a
cache holds in one format for all three kinds.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

__all__ = ["REFERENCE", "QUICK_METHODS", "HFQuantized", "method_names", "resolve_methods", "make_method",
           "make_cache", "prefill_groups", "cache_memory", "held_bytes", "split_seed", "with_seeds"]

REFERENCE = "full precision"


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


_PEERS = {"hf-quanto-k4v4": HFQuantized(nbits=4), "hf-quanto-k2v2": HFQuantized(nbits=2)}


# the quick main job: the default, the 5x point (vector codebooks, and tq-k3v2: its scalar twin at the same bytes),
# the paper's QJL, KIVI and transformers' QuantizedCache
QUICK_METHODS = ("default", "tqv-k3v2", "tqa-5x", "tq-k3v2", "qjl-paper", "kivi-k2v2", "hf-quanto-k4v4")


def _has_auto() -> bool:
    from qjl.cache.config import QJLConfig

    return callable(getattr(QJLConfig, "auto", None))


def has_quanto() -> bool:
    """Whether optimum-quanto (the ``peers`` extra) is importable; False also when ``optimum`` itself is missing."""
    try:
        return importlib.util.find_spec("optimum.quanto") is not None
    except ModuleNotFoundError:  # find_spec imports the parent package
        return False


def method_names() -> list:
    """Every name ``--methods`` accepts (presets, peers, and ``auto-<bits>`` where available)."""
    from qjl.cache.presets import PRESETS

    return [*PRESETS, *_PEERS] + (["auto-<bits>[c<rotations>][s|v][l][u]"] if _has_auto() else [])


def split_seed(name: str) -> tuple:
    """``"tq-k3v3@2"`` -> ``("tq-k3v3", 2)``; a name without ``@`` -> ``(name, None)``."""
    if not isinstance(name, str) or "@" not in name:
        return name, None
    base, _, seed = name.rpartition("@")
    if not seed.isdigit():
        raise ValueError(f"methods: {name!r}: write <method>@<seed>, the seed a non-negative int")
    return base, int(seed)


def with_seeds(names: list, seeds: int) -> list:
    """Each of our cache methods in ``names`` followed by the same at seeds 1 .. seeds - 1 (``name@s``); the
    reference and transformers' peer have no seed and appear once."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be a positive int, got {seeds!r}")
    out = []
    for n in names:
        out.append(n)
        if n != REFERENCE and n not in _PEERS and split_seed(n)[1] is None:
            out += [f"{n}@{s}" for s in range(1, seeds)]
    return out


def _check(name: str) -> None:
    from qjl.cache.presets import PRESETS

    base, seed = split_seed(name)
    if seed is not None:
        if base in _PEERS or base == REFERENCE:
            raise ValueError(f"methods: {name!r}: only our cache methods take a seed")
        _check(base)
        return
    if name in PRESETS:
        return
    if name in _PEERS:
        if not has_quanto():
            raise ValueError(f"methods: {name!r} needs optimum-quanto (pip install optimum-quanto)")
        return
    if name.startswith("auto-") and _has_auto():
        from qjl.cache.config import QJLConfig

        try:
            QJLConfig.named(name)
        except ValueError as e:
            raise ValueError(f"methods: {e}") from None
        return
    raise ValueError(f"methods: unknown {name!r}; choose from {', '.join(method_names())}")


def resolve_methods(names=None, everything: bool = False, seeds: int = 1) -> list:
    """Method names to run, the reference first.  ``names`` None: the quick set (``default`` is
    ``DEFAULT_PRESET``); ``everything``: every preset and the peers that are installed; ``seeds`` > 1: each of
    our methods also at seeds 1 .. seeds - 1 (:func:`with_seeds`)."""
    from qjl.cache.presets import DEFAULT_PRESET, PRESETS

    if everything:
        names = [*PRESETS] + [p for p in _PEERS if has_quanto()]
    elif names is None:
        names = [n for n in QUICK_METHODS if n not in _PEERS or has_quanto()]
    out = [REFERENCE]
    for n in names:
        n = DEFAULT_PRESET if n == "default" else n
        if n == REFERENCE:
            continue
        _check(n)
        if n not in out:
            out.append(n)
    return with_seeds(out, seeds)


def make_method(name: str):
    """The configuration behind a method name: None (full precision), a QJLConfig or an HFQuantized."""
    from qjl.cache.config import QJLConfig

    if name == REFERENCE:
        return None
    _check(name)
    if name in _PEERS:
        return _PEERS[name]
    base, seed = split_seed(name)
    return QJLConfig.named(base) if seed is None else QJLConfig.named(base, seed=seed)


def make_cache(model, cfg):
    """A fresh cache for ``cfg`` (None: ``DynamicCache``)."""
    from transformers import DynamicCache

    from qjl.cache.config import QJLConfig
    from qjl.integrations.transformers.cache import QJLCache

    if cfg is None:
        return DynamicCache(config=model.config)
    if isinstance(cfg, HFQuantized):
        return cfg.make(model)
    if isinstance(cfg, QJLConfig):
        return QJLCache(model, cfg)
    raise TypeError(f"cfg must be None, a QJLConfig or an HFQuantized, got {type(cfg).__name__}")


def prefill_groups(model, caches: dict) -> list:
    """{name: empty cache} -> lists of names whose caches prefill alike (equal
    :func:`qjl.integrations.transformers.prefill.prefill_key`), in the order of their first name; a cache
    without a key is a group of its own.  One forward prefills a group (``shared_prefill``)."""
    from qjl.integrations.transformers.prefill import prefill_key

    groups = {}
    for name, cache in caches.items():
        key = prefill_key(model, cache)
        groups.setdefault(("alone", name) if key is None else key, []).append(name)
    return list(groups.values())


def held_bytes(tensors) -> int:
    """Bytes of the storage behind ``tensors``, each storage counted once, looking inside tensor
    subclasses (quanto's packed tensors) for what is really stored."""
    seen, total, stack = set(), 0, list(tensors)
    while stack:
        t = stack.pop()
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
            names, _ = t.__tensor_flatten__()
            stack.extend(getattr(t, n) for n in names)
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def cache_memory(cache) -> dict:
    """What a cache holds: bytes (total, compressed, exact), fp16 bytes of the same tokens, bits.

    -> {bytes, fp16_bytes, compressed_bytes, exact_bytes, key_bits, value_bits, compressed_bits, exact_bits,
    bits_per_value, x_vs_fp16} -- key/value bits over the compressed tokens (compressed_bits: per value, with the
    key means and per-sequence fits the compressed part also holds), exact_bits over the exact ones, bits_per_value
    over all tokens (everything counted), x_vs_fp16 = fp16 bytes of the same tokens / bytes held.
    """
    from qjl.integrations.transformers.cache import QJLCache

    if isinstance(cache, QJLCache):
        r = cache.memory_report()
        out = {"bytes": r["bytes"], "fp16_bytes": r["fp16_bytes"], "key_bits": r["key_bits"],
               "value_bits": r["value_bits"], "exact_bits": r["exact_bits"],
               "compressed_bytes": r["key_code_bytes"] + r["value_code_bytes"], "compressed_bits": r["compressed_bits"],
               "exact_bytes": r["bytes"] - r["key_code_bytes"] - r["value_code_bytes"]}
        for extra in ("baseline_bytes", "widths"):  # where this version of the report has them
            if extra in r:
                out[extra] = {str(k): list(v) for k, v in r[extra].items()} if extra == "widths" else r[extra]
    else:
        # transformers' QuantizedLayer keeps its quantized part under these (private) names
        qt = [getattr(layer, n, None) for layer in cache.layers for n in ("_quantized_keys", "_quantized_values")]
        et = [getattr(layer, n, None) for layer in cache.layers for n in ("keys", "values")]
        qt, et = [t for t in qt if isinstance(t, torch.Tensor)], [t for t in et if isinstance(t, torch.Tensor)]
        quant, exact = held_bytes(qt), held_bytes(et)
        q_coords, e_coords = sum(t.numel() for t in qt), sum(t.numel() for t in et)
        cbits = 8 * quant / q_coords if q_coords else 0.0
        out = {"bytes": quant + exact, "fp16_bytes": 2 * (q_coords + e_coords), "key_bits": cbits,
               "value_bits": cbits, "exact_bits": 8 * exact / e_coords if e_coords else 0.0,
               "compressed_bytes": quant, "exact_bytes": exact, "compressed_bits": cbits}
    out["bits_per_value"] = 16 * out["bytes"] / out["fp16_bytes"] if out["fp16_bytes"] else 0.0
    out["x_vs_fp16"] = out["fp16_bytes"] / out["bytes"] if out["bytes"] else 0.0
    return out
