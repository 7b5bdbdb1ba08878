"""Key smoothing: exact for softmax, a smaller error for keys with a shared offset, counted in bytes."""

import torch

from qjl import CodecSpec, QJLConfig
from qjl.cache.attention import attend
from qjl.cache.smoothing import channel_mean
from qjl.cache.storage import LayerStore


def test_channel_mean_skips_padding():
    k = torch.randn(2, 3, 10, 8)
    mu = channel_mean(k, torch.tensor([0, 4]))
    assert torch.allclose(mu[0], k[0].mean(1)) and torch.allclose(mu[1], k[1, :, 4:].mean(1))
    assert torch.equal(channel_mean(k[1:, :, 4:]), mu[1:])  # bit-identical to the row alone


def _store(smooth, bits=3, kernel="torch", residual=8):
    key = CodecSpec("turboquant_mse", {"bits": bits, "correct_norm": True})
    cfg = QJLConfig(key=key, value=CodecSpec("turboquant_mse", {"bits": 8}), late_key=None, residual_length=residual,
                    flush_block=4, sink_tokens=2, smooth_keys=smooth, kernel=kernel, exact_dtype=None)
    return LayerStore(0, cfg)


def _keys_with_offset(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, n, 64, generator=g)
    k[..., :4] += 20.0  # a few channels carry a large shared offset (as in real models)
    return k, torch.randn(1, 2, n, 64, generator=g)


def _run(store, k, v, q):
    store.append(k[:, :, :40], v[:, :, :40])
    store.before_attention(None)
    store.flush()
    store.append(k[:, :, 40:], v[:, :, 40:])
    return attend(store, q, None, 64 ** -0.5)


def test_smoothing_keeps_softmax_exact_and_helps_codes():
    """Every stored key shifted by the same mu leaves attention unchanged; with codes, smoothing removes
    the offset the rotation would spread over every coordinate, so the error drops."""
    k, v = _keys_with_offset(41)
    q = torch.randn(1, 4, 1, 64)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                             scale=64 ** -0.5).transpose(1, 2)
    for smooth in (False, True):  # everything exact: smoothing changes nothing (up to float rounding)
        assert torch.allclose(_run(_store(smooth, residual=64), k, v, q), exact, atol=1e-5)
    errs = {}
    for smooth in (False, True):
        for kernel in ("torch", "auto"):
            store = _store(smooth, bits=3, kernel=kernel)
            out = _run(store, k, v, q)
            assert store.n_codes == 28 and (store.mu is not None) == smooth
            errs[smooth, kernel] = (out - exact).norm().item()
        assert abs(errs[smooth, "torch"] - errs[smooth, "auto"]) < 1e-3 * exact.norm()  # every path alike
    assert errs[True, "torch"] < 0.5 * errs[False, "torch"], errs
    store = _store(True)
    _run(store, k, v, q)
    assert store.nbytes()["smoothing"] == 1 * 2 * 64 * 4  # mu: fp32 [B, H, D], counted
