"""The vLLM backend classes without an engine (needs vLLM: ``pytest -m vllm``)."""

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")


@pytest.fixture
def qjl_env(monkeypatch):
    monkeypatch.setenv("QJL_VLLM_PRESET", "tq-k45v3")
    monkeypatch.delenv("QJL_VLLM_CONFIG", raising=False)


def test_spec_customization_sizes_the_pool_by_our_bytes(qjl_env):
    """customize_spec sets state_content_bytes (vLLM marks the hook temporary: this pins it)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    from qjl.integrations.vllm.backend import QJLAttentionBackend
    from qjl.integrations.vllm.layout import content_bytes
    from qjl.integrations.vllm.settings import load_settings

    spec = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    native = spec.page_size_bytes
    ours = customize_attention_spec(QJLAttentionBackend, spec)
    c = content_bytes(load_settings(), 64, 128, torch.bfloat16)
    assert ours.state_content_bytes == c
    assert ours.page_size_bytes == 3 * 128 * c
    assert native == 3 * 128 * 2 * 64 * 2 and native / ours.page_size_bytes > 2.5


def test_register_overrides_cpu_attn_only_when_enabled(qjl_env, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import qjl.integrations.vllm as qv

    assert qv.register() == "CPU_ATTN"
    assert AttentionBackendEnum.CPU_ATTN.get_path() == qv.BACKEND_PATH
    monkeypatch.setenv("QJL_VLLM_PRESET", "no-such-preset")
    with pytest.raises(ValueError, match="QJL_VLLM_PRESET"):
        qv.register()


@pytest.mark.parametrize("kw,name", [({"sliding_window": 0}, "sliding_window"),
                                     ({"sliding_window": 8.5}, "sliding_window"),
                                     ({"logits_soft_cap": 30.0}, "logits_soft_cap"),
                                     ({"alibi_slopes": [1.0]}, "alibi_slopes"), ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
                                     ({"attn_type": "encoder_only"}, "attn_type")])
def test_impl_refuses_what_it_cannot_hold(qjl_env, kw, name):
    from qjl.integrations.vllm.backend import QJLAttentionBackend, QJLAttentionImpl

    with pytest.raises(ValueError, match=name):
        QJLAttentionImpl(num_heads=9, head_size=64, scale=0.125, num_kv_heads=3, **kw)
    assert QJLAttentionBackend.supports_sliding_window()  # a positive int window is served (test_vllm_sliding.py)
    impl = QJLAttentionImpl(num_heads=9, head_size=64, scale=0.125, num_kv_heads=3, sliding_window=64)
    assert impl.sliding_window == 64
