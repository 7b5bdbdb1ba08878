"""The vLLM backend's settings without vLLM: every preset the paged backend can serve loads (default suite)."""

import dataclasses

import pytest

import qjl
from qjl.cache.presets import PRESETS
from qjl.integrations.vllm.settings import PRESET_VALUE_SMOOTHING, check_servable, load_settings


@pytest.mark.parametrize("preset", ["tq-k45v3", "tq-k3v3", "tq-k3v2", "tq-k5v4", "qjl-paper"])
def test_served_presets_keep_their_smoothing_without_heavy_tokens(preset):
    """The paged backend serves a preset's codecs and its key and value smoothing; heavy tokens are off."""
    s = load_settings(environ={"QJL_VLLM_PRESET": preset})
    base = PRESETS[preset]
    assert s.config.smooth_keys == base.smooth_keys and not s.config.heavy_tokens
    # value smoothing: the preset's, except where the paged backend's default differs (tq-k3v2: its capacity)
    assert s.config.smooth_values == PRESET_VALUE_SMOOTHING.get(preset, base.smooth_values)
    assert s.config.smooth_values == (preset in ("tq-k45v3", "tq-k3v3"))
    check_servable(s.config)
    assert s.config.key == base.key and s.config.value == base.value and s.config.seed == base.seed


@pytest.mark.parametrize("name", ["smooth_keys", "smooth_values"])
@pytest.mark.parametrize("value", [False, True, 0, 1])
def test_smoothing_settings(name, value, tmp_path):
    cfg = tmp_path / "q.json"
    cfg.write_text(f'{{"preset": "tq-k45v3", "{name}": {str(value).lower()}}}')
    s = load_settings(environ={"QJL_VLLM_CONFIG": str(cfg)})
    other = "smooth_values" if name == "smooth_keys" else "smooth_keys"
    assert getattr(s.config, name) is bool(value) and getattr(s.config, other) is True  # the other: the preset's


def test_tq_k3v2_smooths_values_only_when_asked():
    assert not load_settings(environ={"QJL_VLLM_PRESET": "tq-k3v2"}).config.smooth_values
    s = load_settings(additional_config={"qjl": {"smooth_values": True}}, environ={"QJL_VLLM_PRESET": "tq-k3v2"})
    assert s.config.smooth_values


@pytest.mark.parametrize("name", ["smooth_keys", "smooth_values"])
@pytest.mark.parametrize("value", [2, -1, 0.5, "yes"])
def test_bad_smoothing_settings_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        load_settings(additional_config={"qjl": {name: value}}, environ={"QJL_VLLM_PRESET": "tq-k45v3"})


def test_unserved_options_are_refused_by_name():
    check_servable(dataclasses.replace(PRESETS["tq-k45v3"], smooth_keys=True, smooth_values=True, heavy_tokens=0))
    with pytest.raises(ValueError, match="heavy_tokens=0"):
        check_servable(dataclasses.replace(PRESETS["tq-k3v2"], smooth_keys=False, smooth_values=False, heavy_tokens=4))
    with pytest.raises(ValueError, match="fit_key_scale=True"):
        check_servable(dataclasses.replace(PRESETS["tq-k45v3"], heavy_tokens=0, fit_key_scale=True))


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_attention_path_settings(name):
    assert getattr(load_settings(environ={"QJL_VLLM_PRESET": "tq-k45v3"}), name) == "auto"
    s = load_settings(additional_config={"qjl": {name: "torch"}}, environ={"QJL_VLLM_PRESET": "tq-k45v3"})
    assert getattr(s, name) == "torch"
    with pytest.raises(ValueError, match=f"'{name}' must be one of"):
        load_settings(additional_config={"qjl": {name: "triton"}}, environ={"QJL_VLLM_PRESET": "tq-k45v3"})
    if name == "decode":  # the paged kernel without the one-call decode step (for comparison)
        assert load_settings(additional_config={"qjl": {name: "kernel"}}).decode == "kernel"
    else:
        with pytest.raises(ValueError, match="'prefill' must be one of"):
            load_settings(additional_config={"qjl": {name: "kernel"}})


def test_values_over_rotations_in_turn_are_served_and_keys_refused():
    """tqv-k3v2 is served as it is (vector codebooks, values over 8 rotations in turn: the pages code each token by
    its position), with the 5x point's paged defaults (no window, no value mean); keys over rotations in turn have no
    score view and are refused by name."""
    s = load_settings(environ={"QJL_VLLM_PRESET": "tqv-k3v2"})
    base = PRESETS["tqv-k3v2"]
    assert s.config.value == base.value and base.value.params["cycles"] == 8 and base.value.name == "turboquant_vq"
    assert s.config.key == base.key and s.config.late_key == base.late_key
    assert s.window_tokens == 0 and not s.config.smooth_values and not s.config.heavy_tokens
    check_servable(s.config)
    cycled = dataclasses.replace(PRESETS["tq-k45v3"], smooth_values=True,
                                 late_key=qjl.CodecSpec("turboquant_mse", {"bits": 5, "cycles": 2}))
    with pytest.raises(ValueError, match=r"late_key codec 'turboquant_mse' over rotations in turn \(cycles=2\)"):
        check_servable(cycled)


def test_split_keys_are_refused_with_the_reason():
    """The split key preset is refused by name, with why and what to use instead (the layout could page it)."""
    with pytest.raises(ValueError, match="turboquant_split.*queries.*tq-k3v3"):
        check_servable(PRESETS["tq-ks3v3"])
    with pytest.raises(ValueError, match="cannot serve key codec 'polarquant'"):
        check_servable(PRESETS["polar-k42v3"])


def test_widths_chosen_from_each_prompt_are_refused():
    """A configuration with an allocation (QJLConfig.auto; the preset tqa-5x) is refused by name, as a preset and as a
    config: its key/value fields are not what it stores, so serving them would give other numbers silently."""
    with pytest.raises(ValueError, match="fixed widths.*QJLConfig.auto.*tqv-k3v2"):
        load_settings(environ={"QJL_VLLM_PRESET": "tqa-5x"})
    with pytest.raises(ValueError, match="fixed widths"):
        check_servable(qjl.QJLConfig.auto(bits_per_value=3.0, heavy_tokens=0))
