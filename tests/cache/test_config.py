import pytest

from qjl import PRESETS, CodecSpec, QJLConfig


def test_presets_state_honest_bits():
    b = PRESETS["qjl-paper"].bits_per_value(128)
    # keys: 256 signs + 16 norm + 64 outlier signs + 16 outlier norm per 128 coords (+ 8 idx bytes / 4096 tokens)
    assert b["key"] == pytest.approx((256 + 16 + 64 + 16 + 64 / 4096) / 128)
    assert b["value"] == pytest.approx(2 + 2 * 16 / 32)
    assert PRESETS["tq-k4v3"].bits_per_value(64)["key"] == pytest.approx(4 + 16 / 64)


def test_per_dim_parameters_scale_with_head_dim():
    spec = CodecSpec("qjl", {}, per_dim={"sketch_dim": 2.0})
    assert spec.resolve(64)["sketch_dim"] == 128 and spec.resolve(80)["sketch_dim"] == 160
    assert spec.build(96).inlier.sketch_dim == 192


def test_layer_overrides():
    cfg = QJLConfig(layer_overrides={0: {"key": CodecSpec("turboquant_mse", {"bits": 6})}})
    assert cfg.specs(0)[0].params == {"bits": 6}
    assert cfg.specs(1)[0] == cfg.key


def test_invalid_configurations():
    with pytest.raises(ValueError, match="codec must be one of"):
        CodecSpec("int3")
    with pytest.raises(ValueError, match="no parameter"):
        CodecSpec("uniform", {"bitz": 3})
    with pytest.raises(ValueError, match="bits"):
        QJLConfig(key=CodecSpec("turboquant_mse", {"bits": 12}))
    with pytest.raises(ValueError, match="residual_length"):
        QJLConfig(residual_length=-1)
    with pytest.raises(ValueError, match="flush_block"):
        QJLConfig(flush_block=0)
    with pytest.raises(ValueError, match="multiple of kivi"):
        QJLConfig(key=CodecSpec("kivi", {"group_size": 32}), flush_block=8)
    with pytest.raises(ValueError, match="per token"):
        QJLConfig(value=CodecSpec("kivi"))
    with pytest.raises(ValueError, match="score_path"):
        QJLConfig(score_path="fast")
    with pytest.raises(ValueError, match="kernel must be"):
        QJLConfig(kernel="cuda")
    with pytest.raises(ValueError, match="layer_overrides"):
        QJLConfig(layer_overrides={0: {"keys": CodecSpec("uniform")}})
    with pytest.raises(ValueError, match="preset"):
        QJLConfig.preset("best")
    with pytest.raises(ValueError, match="per_dim"):
        CodecSpec("qjl", per_dim={"sketch_dim": -1})


def test_defaults():
    from qjl.cache.presets import DEFAULT_PRESET

    assert QJLConfig() == PRESETS["tq-k4v3"]
    assert DEFAULT_PRESET in PRESETS


def test_late_key_codec_for_deeper_layers():
    late = CodecSpec("turboquant_mse", {"bits": 5})
    cfg = QJLConfig(late_key=late, late_fraction=0.5)
    assert [cfg.specs(i, 30)[0] == late for i in (0, 14, 15, 29)] == [False, False, True, True]
    assert cfg.specs(3, 30)[1] == cfg.value
    b = cfg.bits_per_value(64, num_layers=30)
    assert b["key"] == pytest.approx((4.25 + 5.25) / 2)
    with pytest.raises(ValueError, match="late_fraction"):
        QJLConfig(late_key=late, late_fraction=0)
    assert PRESETS["tq-k45v3"].bits_per_value(64, num_layers=30)["kv"] == pytest.approx(4.0)
