"""Presets: measured configurations, cheap to import (nothing built at import, #10.4)."""

import pytest

from qjl import PRESETS, QJLConfig
from qjl.cache.presets import DEFAULT_PRESET


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_serves_the_embedded_model_shape(name):
    """Each preset builds at the embedded model's head_dim (64) and the paper's (128), for 30 layers."""
    for d in (64, 128):
        PRESETS[name].check_model(d, 30)
        bits = PRESETS[name].bits_per_value(d, 30)
        assert 0 < bits["kv"] < 16


def test_default_preset():
    assert QJLConfig() == PRESETS[DEFAULT_PRESET]
    assert QJLConfig.preset(DEFAULT_PRESET, residual_length=64) == QJLConfig(residual_length=64)
