"""Named cache configurations (``QJLConfig.preset(name)``), each measured in the README.

``DEFAULT_PRESET`` is what ``QJLCache(model)`` uses without a config.
"""

from __future__ import annotations

from qjl.cache.config import CodecSpec, QJLConfig

__all__ = ["PRESETS", "DEFAULT_PRESET"]


def _uniform(bits, group=64):
    return CodecSpec("uniform", {"bits": bits, "group_size": group})


def _tq(bits, correct_norm=True, norm_dtype="fp16"):
    params = {"bits": bits, "correct_norm": correct_norm}
    return CodecSpec("turboquant_mse", params if norm_dtype == "fp16" else {**params, "norm_dtype": norm_dtype})


_QJL_PAPER_KEYS = CodecSpec("qjl", {"n_outliers": 8}, per_dim={"sketch_dim": 2.0, "outlier_sketch_dim": 0.5})

PRESETS = {
    # the paper's configuration, as published: m = 2d sign bits (256 at d = 128), 8 outlier channels with
    # their own sketch, 2-bit token-wise values in groups of 32, the 128 most recent tokens exact
    "qjl-paper": QJLConfig(key=_QJL_PAPER_KEYS, value=_uniform(2, 32), sink_tokens=0),
    # QJL with a larger sketch (4d) and 4-bit values
    "qjl-4d": QJLConfig(key=CodecSpec("qjl", {"n_outliers": 8}, per_dim={"sketch_dim": 4.0, "outlier_sketch_dim": 0.5}),
                        value=_uniform(4), sink_tokens=0),
    # TurboQuant_mse keys and values with the norm correction, 4 exact sink tokens (measured best; see README)
    "tq-k5v4": QJLConfig(key=_tq(5), value=_tq(4)),
    "tq-k4v3": QJLConfig(key=_tq(4), value=_tq(3)),
    # 5-bit keys in the deeper half of the layers: 4.0 bits per value
    "tq-k45v3": QJLConfig(key=_tq(4), value=_tq(3), late_key=_tq(5)),
    "tq-k3v3": QJLConfig(key=_tq(3), value=_tq(3)),
    # the 5x point (benchmarks/five_x_search.py): 3-bit keys (4-bit in the last 7% of the layers), 2-bit values
    # with 8-bit (float8 e4m3) norms, an fp16 exact window of 136 (+< 8) tokens
    "tq-k3v2": QJLConfig(key=_tq(3), value=_tq(2, norm_dtype="fp8"), late_key=_tq(4), late_fraction=0.07,
                         residual_length=136, flush_block=8, exact_dtype="fp16"),
    "tq-k2v2": QJLConfig(key=_tq(2), value=_tq(2)),
    # the paper's TurboQuant_mse (no norm correction) with uniform values and no sinks
    "tq-paper-k4v3": QJLConfig(key=_tq(4, False), value=_uniform(3), sink_tokens=0),
    "tqprod-k4v3": QJLConfig(key=CodecSpec("turboquant_prod", {"bits": 4}), value=_tq(3)),
    "polar-k42v3": QJLConfig(key=CodecSpec("polarquant", {"bits_per_level": (4, 2)}), value=_tq(3)),
    "uniform-k4v3": QJLConfig(key=_uniform(4), value=_uniform(3), sink_tokens=0),
    # the KIVI baseline as published: per-channel keys in groups of 32 tokens, per-token values, no sinks
    "kivi-k2v2": QJLConfig(key=CodecSpec("kivi", {"bits": 2, "group_size": 32}), value=_uniform(2, 32), sink_tokens=0),
    "kivi-k3v3": QJLConfig(key=CodecSpec("kivi", {"bits": 3, "group_size": 32}), value=_uniform(3, 32), sink_tokens=0),
    "kivi-k4v4": QJLConfig(key=CodecSpec("kivi", {"bits": 4, "group_size": 32}), value=_uniform(4, 32), sink_tokens=0),
}
DEFAULT_PRESET = "tq-k45v3"
