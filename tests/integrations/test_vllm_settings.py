"""The vLLM backend's settings without vLLM: every preset the paged backend can serve loads (default suite)."""

import dataclasses

import pytest

from qjl.cache.presets import PRESETS
from qjl.integrations.vllm.settings import check_servable, load_settings


@pytest.mark.parametrize("preset", ["tq-k45v3", "tq-k3v3", "tq-k3v2", "tq-k5v4", "qjl-paper"])
def test_served_presets_keep_key_smoothing_only(preset):
    """The paged backend serves a preset's codecs and its key smoothing; value smoothing and heavy tokens are off."""
    s = load_settings(environ={"QJL_VLLM_PRESET": preset})
    base = PRESETS[preset]
    assert s.config.smooth_keys == base.smooth_keys
    assert not (s.config.smooth_values or s.config.heavy_tokens)
    check_servable(s.config)
    assert s.config.key == base.key and s.config.value == base.value and s.config.seed == base.seed


@pytest.mark.parametrize("value", [False, True, 0, 1])
def test_smooth_keys_setting(value, tmp_path):
    cfg = tmp_path / "q.json"
    cfg.write_text(f'{{"preset": "tq-k45v3", "smooth_keys": {str(value).lower()}}}')
    s = load_settings(environ={"QJL_VLLM_CONFIG": str(cfg)})
    assert s.config.smooth_keys is bool(value)


@pytest.mark.parametrize("value", [2, -1, 0.5, "yes"])
def test_bad_smooth_keys_is_refused_by_name(value):
    with pytest.raises(ValueError, match="smooth_keys"):
        load_settings(additional_config={"qjl": {"smooth_keys": value}}, environ={"QJL_VLLM_PRESET": "tq-k45v3"})


def test_unserved_options_are_refused_by_name():
    check_servable(dataclasses.replace(PRESETS["tq-k45v3"], smooth_keys=True, smooth_values=False, heavy_tokens=0))
    with pytest.raises(ValueError, match="smooth_values"):
        check_servable(dataclasses.replace(PRESETS["tq-k3v2"], smooth_keys=False, smooth_values=True))
    with pytest.raises(ValueError, match="heavy_tokens=0"):
        check_servable(dataclasses.replace(PRESETS["tq-k3v2"], smooth_keys=False, smooth_values=False, heavy_tokens=4))
