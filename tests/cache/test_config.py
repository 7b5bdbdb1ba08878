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

    assert QJLConfig() == PRESETS[DEFAULT_PRESET] == PRESETS["tq-k45v3"]
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


def test_default_config_is_the_default_preset_and_hashable():
    """QJLConfig() is DEFAULT_PRESET (#10.6); configs are hashable and cannot change after validation (#11.6)."""
    from qjl.cache.presets import DEFAULT_PRESET

    assert QJLConfig() == QJLConfig.preset(DEFAULT_PRESET)
    assert hash(QJLConfig()) == hash(PRESETS[DEFAULT_PRESET])
    assert len({QJLConfig(), QJLConfig(), QJLConfig(residual_length=64)}) == 2
    assert len({cfg for cfg in PRESETS.values()}) == len(PRESETS)
    spec = CodecSpec("turboquant_mse", {"bits": 4})
    with pytest.raises(TypeError):
        spec.params["bits"] = 12  # read-only: a spec cannot bypass its validation
    cfg = QJLConfig(layer_overrides={1: {"key": spec}})
    with pytest.raises(TypeError):
        cfg.layer_overrides[2] = {"key": spec}
    assert hash(cfg) == hash(QJLConfig(layer_overrides={1: {"key": CodecSpec("turboquant_mse", {"bits": 4})}}))


@pytest.mark.parametrize("make,error,match", [
    (lambda: QJLConfig(layer_overrides=[1, 2]), TypeError, "layer_overrides must be a dict"),
    (lambda: CodecSpec("uniform", None), TypeError, "params of codec 'uniform' must be a dict"),
    (lambda: QJLConfig(seed=2 ** 70), ValueError, r"seed must be an int in \[0, 2\*\*62\)"),
    (lambda: QJLConfig(seed=-1), ValueError, "seed"),
    (lambda: CodecSpec("qjl", per_dim={"sketch_dim": float("nan")}), ValueError, "finite positive"),
    (lambda: CodecSpec("turboquant_mse", per_dim={"bits": 0.05}), ValueError, "per_dim.*not allowed"),
    (lambda: QJLConfig(late_fraction=True), ValueError, "late_fraction"),
    (lambda: QJLConfig(compress_sliding="yes"), TypeError, "compress_sliding must be a bool"),
    (lambda: QJLConfig(smooth_keys=1), TypeError, "smooth_keys must be a bool"),
    (lambda: QJLConfig(smooth_values="on"), TypeError, "smooth_values must be a bool"),
    (lambda: QJLConfig(heavy_tokens=-1), ValueError, "heavy_tokens"),
    (lambda: QJLConfig(heavy_tokens=2.5), TypeError, "heavy_tokens must be an int"),
    (lambda: QJLConfig(residual_length=1.5), TypeError, "residual_length must be an int"),
    (lambda: QJLConfig(key="turboquant_mse"), TypeError, "key must be a qjl.CodecSpec"),
    (lambda: QJLConfig(late_key=CodecSpec("turboquant_mse", {"bits": 9})), ValueError, "bits must be in 1..8"),
    (lambda: CodecSpec("qjl"), ValueError, "needs parameter"),
    (lambda: CodecSpec(3), ValueError, "codec must be one of"),
])
def test_unclear_errors_are_named(make, error, match):
    """Issue #11.6: every bad input is a ValueError/TypeError naming the argument and what is allowed."""
    with pytest.raises(error, match=match):
        make()


def test_model_dependent_checks():
    """What needs the head dimension or the layer count fails in check_model, before any token."""
    QJLConfig().check_model(64, 30)
    with pytest.raises(ValueError, match="layer_overrides name layer"):
        QJLConfig(layer_overrides={40: {"key": CodecSpec("turboquant_mse")}}).check_model(64, 30)
    with pytest.raises(ValueError, match="cannot serve head_dim=8"):
        QJLConfig(key=CodecSpec("turboquant_mse", {"rotation": "hadamard"})).check_model(8, 2)


def test_auto_config():
    cfg = QJLConfig.auto(bits_per_value=3.0, residual_length=64, queries=32)
    assert cfg.allocation.bits_per_value == 3.0 and cfg.allocation.queries == 32 and cfg.residual_length == 64
    assert cfg.bits_per_value(64)["kv"] == 3.0 and "auto widths" in cfg.describe(64)
    hash(cfg)
    with pytest.raises(ValueError, match="bits_per_value"):
        QJLConfig.auto(bits_per_value=0)
    with pytest.raises(TypeError, match="key_candidates"):
        QJLConfig.auto(bits_per_value=3.0, key_candidates=("turboquant_mse",))


def test_named_takes_presets_and_auto_budgets():
    from qjl import QJLConfig

    assert QJLConfig.named("tq-k3v2", kernel="torch") == QJLConfig.preset("tq-k3v2", kernel="torch")
    auto = QJLConfig.named("auto-2.5", residual_length=64)
    assert auto.allocation.bits_per_value == 2.5 and auto.residual_length == 64
    for bad, match in (("auto-x", "auto-<bits"), ("auto-0.5", r"\[1, 16\]"), ("tq-k9", "preset"),
                       ("auto-3.0c", "auto-<bits"), ("auto-3.0c0", "value_cycles")):
        with pytest.raises(ValueError, match=match):
            QJLConfig.named(bad)
    cyc = QJLConfig.named("auto-3.0c8")  # value candidates over 8 rotations in turn (the default), the same widths
    plain = QJLConfig.named("auto-3.0c1")
    assert QJLConfig.named("auto-3.0") == cyc and plain.allocation.value_cycles == 1
    assert all("cycles" not in s.params for s in plain.allocation.value_candidates)
    assert cyc.allocation.value_cycles == 8 and "8 rotations in turn" in cyc.allocation.describe()
    assert [dict(s.params, cycles=8) for s in plain.allocation.value_candidates] == \
        [dict(s.params) for s in cyc.allocation.value_candidates]
    assert cyc.allocation.key_candidates == plain.allocation.key_candidates
    # vector codebooks (turboquant_vq) for the 2-4-bit key candidates by default; a final s: none, v: keys and values
    dft, sca, both = QJLConfig.named("auto-3.0"), QJLConfig.named("auto-3.0c8s"), QJLConfig.named("auto-3.0v")
    assert "vector codebooks for keys" in dft.allocation.describe() and "vector" not in sca.allocation.describe()
    assert "for keys and values" in both.allocation.describe()
    kind = lambda specs: [s.name for s in specs]  # noqa: E731
    assert kind(dft.allocation.key_candidates) == ["turboquant_vq"] * 2 + ["turboquant_mse"] * 2  # 3, 4 | 5, 6 bits
    assert kind(dft.allocation.value_candidates) == kind(sca.allocation.value_candidates) == ["turboquant_mse"] * 6
    assert kind(both.allocation.value_candidates) == ["turboquant_vq"] * 6
    for a, b in ((dft, sca), (both, sca)):
        for role in ("key_candidates", "value_candidates"):
            assert [s.params for s in getattr(a.allocation, role)] == [s.params for s in getattr(b.allocation, role)]
    with pytest.raises(ValueError, match="vector_keys"):
        QJLConfig.auto(bits_per_value=3.0, vector_keys=1)
    with pytest.raises(ValueError, match="auto-<bits"):
        QJLConfig.named("auto-3.0x")
    # widths per KV head by default; a final l: per layer (with any other suffix), the candidates unchanged
    per_layer, sca_layer = QJLConfig.named("auto-3.0l"), QJLConfig.named("auto-3.0c8sl")
    assert dft.allocation.per_head and not per_layer.allocation.per_head and not sca_layer.allocation.per_head
    assert "per KV head" in dft.allocation.describe() and "per layer" in per_layer.allocation.describe()
    assert per_layer.allocation.key_candidates == dft.allocation.key_candidates
    assert sca_layer.allocation.value_candidates == sca.allocation.value_candidates
    with pytest.raises(ValueError, match="per_head"):
        QJLConfig.auto(bits_per_value=3.0, per_head=1)
    with pytest.raises(ValueError, match="auto-<bits"):
        QJLConfig.named("auto-3.0lv")
