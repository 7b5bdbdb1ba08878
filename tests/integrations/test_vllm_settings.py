"""The vLLM backend's settings without vLLM: every preset the paged backend can serve loads (default suite)."""

import dataclasses

import pytest

from qjl.cache.presets import PRESETS
from qjl.integrations.vllm.settings import check_servable, load_settings


@pytest.mark.parametrize("preset", ["tq-k45v3", "tq-k3v3", "tq-k3v2", "tq-k5v4", "qjl-paper"])
def test_served_presets_load_without_smoothing(preset):
    """The TurboQuant presets smooth keys in transformers; the paged backend serves their codecs without it."""
    s = load_settings(environ={"QJL_VLLM_PRESET": preset})
    assert not (s.config.smooth_keys or s.config.smooth_values or s.config.heavy_tokens)
    check_servable(s.config)
    base = PRESETS[preset]
    assert s.config.key == base.key and s.config.value == base.value and s.config.seed == base.seed


def test_smoothing_is_refused_by_name():
    with pytest.raises(ValueError, match="smooth_keys"):
        check_servable(dataclasses.replace(PRESETS["tq-k45v3"], smooth_keys=True))
    with pytest.raises(ValueError, match="smooth_values"):
        check_servable(dataclasses.replace(PRESETS["tq-k3v2"], smooth_keys=False, smooth_values=True))
    with pytest.raises(ValueError, match="heavy_tokens=0"):
        check_servable(dataclasses.replace(PRESETS["tq-k3v2"], smooth_keys=False, smooth_values=False, heavy_tokens=4))
