"""How the vLLM backend is switched on and configured (no vLLM import).

The plugin is inert unless one of these environment variables is set (they reach vLLM's
worker processes, which inherit the environment):

* ``QJL_VLLM_PRESET=<preset>``: a :data:`qjl.PRESETS` name, e.g. ``tq-k45v3``;
* ``QJL_VLLM_CONFIG=<file.json>``: ``{"preset": ..., "sinks": ..., "window": ..., "seed": ...,
  "smooth_keys": ..., "smooth_values": ..., "decode": ..., "prefill": ...}`` (every key optional; ``preset`` defaults to
  :data:`qjl.config.DEFAULT_PRESET`).

When enabled, vLLM's ``additional_config={"qjl": {...}}`` (same keys) overrides both.  Keys:

* ``preset``: the codecs (per-layer widths included), the seed and key and value smoothing come from this preset
  (its heavy tokens, on in some presets for transformers, are turned off: the paged backend does not implement
  them);
* ``smooth_keys``, ``smooth_values``: true / false (or 1 / 0): key / value smoothing (:mod:`.smoothing`);
  default: the preset's (value smoothing: off for ``tq-k3v2`` and ``tqv-k3v2``, :data:`PRESET_VALUE_SMOOTHING`);
* ``sinks``: exact attention-sink tokens (default: the preset's ``sink_tokens``);
* ``window``: ring slots for exact most-recent tokens beside the sinks' slots in every page (default
  :data:`DEFAULT_WINDOW`, 0 for ``tq-k3v2`` and ``tqv-k3v2``); past a sequence's first block the sink slots ring
  too, so the last ``sinks + window`` tokens are exact there (:mod:`.layout`; docs/vllm.md measures what it costs
  and buys);
* ``seed``: base seed (layer ``l`` uses ``seed + 1000 l`` for keys, ``+ 1`` for values, as
  :class:`qjl.QJLCache` does);
* ``decode``: "auto" (a paged kernel where :mod:`qjl.kernels` provides one, else the reference; on the CPU a
  decode-only step of a layer in one C call, :mod:`.fused`), "kernel" (the paged kernel without that one call:
  smoothing, store and attention called apart, for comparison) or "torch" (the plain-torch reference of
  :mod:`.paged`);
* ``prefill``: "auto" (prefill and chunk rows through vLLM's own CPU attention kernel over the decoded history,
  :class:`.prefill.VLLMPrefill`, on the CPU where its ops load; else the reference) or "torch" (torch's SDPA,
  :func:`.paged.paged_attention_reference`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from ...cache.config import QJLConfig
from ...cache.presets import DEFAULT_PRESET, PRESETS

__all__ = ["VLLMSettings", "ENV_PRESET", "ENV_CONFIG", "DEFAULT_WINDOW", "enabled", "load_settings",
           "SERVABLE_KEYS", "SERVABLE_VALUES", "PRESET_WINDOWS", "PRESET_VALUE_SMOOTHING"]

ENV_PRESET = "QJL_VLLM_PRESET"
ENV_CONFIG = "QJL_VLLM_CONFIG"
DEFAULT_WINDOW = 4  # exact recent tokens per sequence; docs/vllm.md measures what they cost and buy
# presets whose point is memory: the 5x preset keeps >= 4x native's tokens only without a window (block 128)
PRESET_WINDOWS = {"tq-k3v2": 0, "tqv-k3v2": 0}
# ... and without value smoothing: its mean does not fit the 5x preset's page padding beside the key mean (3% fewer
# tokens), for no lower KL against native (docs/history.md, "Value smoothing in pages"); the other presets keep theirs
PRESET_VALUE_SMOOTHING = {"tq-k3v2": False, "tqv-k3v2": False}
SERVABLE_KEYS = ("turboquant_mse", "turboquant_vq", "qjl")
# key codecs the paged layout could hold but the backend does not serve, and why
UNSERVED_KEYS = {"turboquant_split": "split keys choose their channels from the prompt's queries per sequence; vLLM's "
                                     "pages would fit them per block from its keys alone, which measured no better "
                                     "than one rotation (docs/cache.md): use preset 'tq-k3v3' (the same bits) for vLLM"}
SERVABLE_VALUES = ("turboquant_mse", "turboquant_vq", "uniform")
# QJLConfig options fitted per sequence to its prompt, which the paged backend does not implement (turned off)
UNSERVED_OPTIONS = {"heavy_tokens": 0}  # name: its off value
_KEYS = ("preset", "sinks", "window", "seed", "smooth_keys", "smooth_values", "decode", "prefill")


@dataclass(frozen=True)
class VLLMSettings:
    """The backend's configuration: a preset's codecs plus the paged exactness features."""

    preset: str = DEFAULT_PRESET
    sinks: int | None = None
    window: int | None = None
    seed: int | None = None
    smooth_keys: bool | None = None
    smooth_values: bool | None = None
    decode: str = "auto"
    prefill: str = "auto"

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"qjl preset (env {ENV_PRESET} / 'preset') must be one of {sorted(PRESETS)}, "
                             f"got {self.preset!r}")
        for name in ("sinks", "window", "seed"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"qjl setting {name!r} must be a non-negative int, got {v!r}")
        for name in ("smooth_keys", "smooth_values"):
            v = getattr(self, name)
            if v is not None and (v not in (0, 1) or isinstance(v, float)):
                raise ValueError(f"qjl setting {name!r} must be true, false, 1, 0 or null, got {v!r}")
        for name, allowed in (("decode", ("auto", "kernel", "torch")), ("prefill", ("auto", "torch"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"qjl setting {name!r} must be one of {allowed}, got {getattr(self, name)!r}")
        check_servable(self.config)

    @property
    def config(self) -> QJLConfig:
        # the preset's codecs, seed and smoothing without the options the paged backend does not implement
        over = dict(UNSERVED_OPTIONS)
        if self.seed is not None:
            over["seed"] = self.seed
        if self.preset in PRESET_VALUE_SMOOTHING:
            over["smooth_values"] = PRESET_VALUE_SMOOTHING[self.preset]
        for name in ("smooth_keys", "smooth_values"):
            if getattr(self, name) is not None:
                over[name] = bool(getattr(self, name))
        return QJLConfig.preset(self.preset, **over)

    @property
    def window_tokens(self) -> int:
        """The exact window: ``window`` if set, else the preset's default (:data:`PRESET_WINDOWS`, else
        :data:`DEFAULT_WINDOW`)."""
        return PRESET_WINDOWS.get(self.preset, DEFAULT_WINDOW) if self.window is None else self.window

    @property
    def sink_tokens(self) -> int:
        return self.config.sink_tokens if self.sinks is None else self.sinks

    def updated(self, values: dict, source: str) -> "VLLMSettings":
        if not isinstance(values, dict):
            raise TypeError(f"{source} must be a JSON object / dict, got {type(values).__name__}")
        unknown = sorted(set(values) - set(_KEYS))
        if unknown:
            raise ValueError(f"{source} has unknown qjl setting(s) {unknown}; allowed: {list(_KEYS)}")
        return replace(self, **values)


def check_servable(config: QJLConfig) -> None:
    """Refuse codecs and options the paged backend cannot serve, naming the setting."""
    if config.allocation is not None:  # (its key / value fields are placeholders: serving them would be wrong)
        raise ValueError("the qjl vLLM backend serves fixed widths: a configuration whose widths are chosen per layer "
                         "from each prompt (QJLConfig.auto, e.g. the preset 'tqa-5x') is not served; choose a fixed "
                         "preset (e.g. 'tqv-k3v2' at the same 5x point)")
    if config.fit_key_scale:
        raise ValueError("the qjl vLLM backend does not fit the coded keys' score scale from each prompt "
                         "(fit_key_scale=True): serve the configuration with fit_key_scale=False")
    specs = [("key", config.key), ("value", config.value)]
    if config.late_key is not None:
        specs.append(("late_key", config.late_key))
    for layer, over in config.layer_overrides.items():
        specs += [(f"layer_overrides[{layer}][{r!r}]", s) for r, s in over.items()]
    for where, spec in specs:
        allowed = SERVABLE_VALUES if where == "value" or where.endswith("'value']") else SERVABLE_KEYS
        if allowed is SERVABLE_KEYS and spec.name in UNSERVED_KEYS:
            raise ValueError(f"the qjl vLLM backend does not serve {where} codec {spec.name!r}: "
                             f"{UNSERVED_KEYS[spec.name]}")
        if spec.name not in allowed:
            raise ValueError(f"the qjl vLLM backend cannot serve {where} codec {spec.name!r}: it serves "
                             f"{list(allowed)} (per-token codes that fit paged blocks)")
        if allowed is SERVABLE_KEYS and spec.params.get("cycles", 1) != 1:  # (values over them are served)
            raise ValueError(f"the qjl vLLM backend cannot serve {where} codec {spec.name!r} over rotations in turn "
                             f"(cycles={spec.params['cycles']!r}): keys so coded have no score view; use cycles=1")
    for name, off in UNSERVED_OPTIONS.items():
        if getattr(config, name) != off:
            raise ValueError(f"the qjl vLLM backend does not implement {name} (fitted per sequence to its prompt; "
                             f"vLLM's pages are shared): set {name}={off!r} for vLLM")


def enabled(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return bool(env.get(ENV_PRESET) or env.get(ENV_CONFIG))


def load_settings(additional_config: dict | None = None, environ=None) -> VLLMSettings:
    """Settings from the environment, then ``additional_config["qjl"]`` (raises ValueError naming
    the setting on anything invalid)."""
    env = os.environ if environ is None else environ
    s = VLLMSettings(preset=env.get(ENV_PRESET) or DEFAULT_PRESET)
    path = env.get(ENV_CONFIG)
    if path:
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{ENV_CONFIG}={path!r} is not a readable JSON file: {e}") from None
        s = s.updated(data, f"{ENV_CONFIG} file {path}")
    extra = (additional_config or {}).get("qjl")
    if extra is not None:
        s = s.updated(extra, "additional_config['qjl']")
    return s
