"""The compressed cache, independent of any framework: configuration and presets, a layer's storage,
and attention over a layer.  Framework glue lives in :mod:`qjl.integrations`."""

from qjl.cache.config import CodecSpec, QJLConfig
from qjl.cache.presets import DEFAULT_PRESET, PRESETS

__all__ = ["CodecSpec", "DEFAULT_PRESET", "PRESETS", "QJLConfig"]
