"""Prefill rows through vLLM's CPU attention kernel against the torch reference (needs vLLM: ``pytest -m vllm``)."""

import pytest
import torch

from qjl.integrations.vllm.layout import layer_layout
from qjl.integrations.vllm.paged import page_fields, paged_attention_reference
from qjl.integrations.vllm.settings import VLLMSettings
from qjl.integrations.vllm.smoothing import smooth_keys
from qjl.integrations.vllm.step import StepPlan, forward_batch
from qjl.integrations.vllm.writes import write_codes

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

HKV, HQ, BS = 3, 9, 16


def _filled(preset, d, n, dtype=torch.bfloat16, sliding_window=None, seed=0):
    """A one-sequence page pool holding ``n`` tokens written as the backend writes them -> (layout, fields, table)."""
    lay = layer_layout(VLLMSettings(preset=preset), 5, 30, d, BS, dtype, sliding_window=sliding_window)
    nblocks = (n + 600) // BS + 2
    pages = torch.zeros(nblocks, HKV, BS, lay.content_bytes // 2, dtype=dtype)
    fields = page_fields(lay, pages)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(nblocks, generator=g)[None, :]
    q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    plan = StepPlan.build(torch.tensor([0, n]), torch.tensor([n]), table, BS, lay.sinks, lay.window,
                          sliding_window=sliding_window)
    if lay.smooth_keys:
        k = smooth_keys(fields, plan, k)
    write_codes(lay, fields, k, v, None, plan=plan)
    forward_batch(lay, fields, q, k, v, table, torch.tensor([0, n]), torch.tensor([n]), d ** -0.5, plan=plan)
    return lay, fields, table, g


@pytest.mark.parametrize("preset,d,n,c,dtype", [("tq-k45v3", 64, 300, 200, torch.bfloat16),
                                                ("tq-k3v2", 64, 40, 7, torch.bfloat16),
                                                ("tq-k45v3", 128, 130, 64, torch.bfloat16),
                                                ("tq-k5v4", 80, 50, 33, torch.bfloat16),
                                                ("tq-k45v3", 64, 300, 200, torch.float16),
                                                ("tq-k45v3", 64, 3000, 64, torch.bfloat16)])
@pytest.mark.parametrize("rotate", ["never", "always", "auto"])
def test_the_vllm_kernel_attends_what_the_reference_attends(preset, d, n, c, dtype, rotate):
    """A chunk of ``c`` tokens after ``n`` in the pages: vLLM's kernel over the scratch cache agrees with the
    float32 reference to bf16 precision (the history and the chunk are rounded to the model's dtype before the
    kernel), in the model's basis and in the codecs' rotated one (the queries, the exact tokens and the output
    rotated instead of the history; ``auto`` picks it for the long history of the last case).  bf16 runs the AMX
    variant on CPUs that have it, fp16 and head size 80 the vector ones."""
    from qjl.integrations.vllm.prefill import VLLMPrefill

    lay, fields, table, g = _filled(preset, d, n, dtype=dtype)
    q, k, v = (torch.randn(c, h, d, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    args = (q, k.float(), v.float(), fields, table, torch.tensor([0, c]), torch.tensor([n + c]), lay, d ** -0.5)
    ref = paged_attention_reference(*args)
    pre = VLLMPrefill(rotate)
    got = pre(*args)
    assert pre.usable and pre.ran, "vLLM's CPU kernel did not run"
    assert got.dtype == torch.float32 and got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err < 0.02 * ref.abs().max().item(), err
    # a wrong scale or a non-causal chunk would be far off: the check above has teeth
    assert (pre(*args[:-1], d ** -0.5 * 1.5) - ref).abs().max().item() > 10 * err


@pytest.mark.parametrize("rotate", ["never", "always"])
@pytest.mark.parametrize("n,c,w", [(100, 20, 32), (40, 64, 32), (300, 128, 64), (10, 5, 32)])
def test_sliding_window_layers_through_the_vllm_kernel(n, c, w, rotate):
    """A sliding-window layer (no sinks; the history from the first position the chunk sees): vLLM's kernel with
    its ``sliding_window`` over the shifted positions agrees with the reference's masks to bf16 precision."""
    from qjl.integrations.vllm.prefill import VLLMPrefill

    lay, fields, table, g = _filled("tq-k45v3", 64, n, sliding_window=w)
    q, k, v = (torch.randn(c, h, 64, generator=g).bfloat16() for h in (HQ, HKV, HKV))
    args = (q, k.float(), v.float(), fields, table, torch.tensor([0, c]), torch.tensor([n + c]), lay, 0.125)
    ref = paged_attention_reference(*args)
    pre = VLLMPrefill(rotate)
    got = pre(*args)
    assert pre.ran
    err = (got - ref).abs().max().item()
    assert err < 0.02 * ref.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_the_kernel_variant_is_the_one_vllm_picks(dtype, d):
    """:func:`kernel_isa` agrees with vLLM's own CPU backend's choice for the scratch cache's blocks (on an AMX CPU
    ``"amx"`` for bf16: the fixed ``"vec"`` it replaced made the prefill 2.5x slower than native's there)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from qjl.integrations.vllm.prefill import SCRATCH_BLOCK, kernel_isa

    assert kernel_isa(dtype, d) == _get_attn_isa(dtype, SCRATCH_BLOCK, d)


@pytest.mark.parametrize("n,c", [(40, 7), (200, 100), (121, 7)])
def test_unfilled_scratch_slots_never_reach_the_output(n, c):
    """The scratch cache is allocated uninitialized (its blocks are filled by vLLM's cache write) but for the last
    block, whose unused slots the kernel still reads as part of a tile: under torch's deterministic mode every
    uninitialized float is NaN, so a slot left unzeroed would show in the output."""
    from qjl.integrations.vllm.prefill import VLLMPrefill

    lay, fields, table, g = _filled("tq-k45v3", 64, n)
    q, k, v = (torch.randn(c, h, 64, generator=g).bfloat16() for h in (HQ, HKV, HKV))
    args = (q, k.float(), v.float(), fields, table, torch.tensor([0, c]), torch.tensor([n + c]), lay, 0.125)
    ref = paged_attention_reference(*args)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.empty(4).isnan().all(), "torch no longer fills uninitialized memory with NaN here"
        got = VLLMPrefill()(*args)
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_the_rotated_basis_is_taken_only_where_it_is_exact_and_cheaper():
    """:func:`.paged.rotated_basis` gives the inverse of each codec's unmix for TurboQuant (orthogonal: scores and
    mixes unchanged) and None for a codec without a rotation (token-wise values) or a non-orthogonal map; ``auto``
    rotates only where the history is long against the chunk; a bad ``rotate`` is refused by name."""
    from qjl.codecs.tokenwise import TokenwiseQuantizer
    from qjl.codecs.turboquant import TurboQuantMSE
    from qjl.integrations.vllm.paged import rotated_basis
    from qjl.integrations.vllm.prefill import VLLMPrefill
    from qjl.kernels.paged import unmix_matrix

    kc, vc = TurboQuantMSE(64, 3, seed=1), TurboQuantMSE(64, 2, seed=2)
    rk, rv = rotated_basis(kc, vc, 64)
    assert torch.allclose(rk @ unmix_matrix(kc), torch.eye(64), atol=1e-5)
    assert torch.allclose(rv @ unmix_matrix(vc), torch.eye(64), atol=1e-5)
    x, y = torch.randn(5, 64), torch.randn(7, 64)
    assert torch.allclose((x @ rk) @ (y @ rk).T, x @ y.T, atol=1e-4)
    assert rotated_basis(kc, TokenwiseQuantizer(64, 2, group_size=32), 64) is None
    assert rotated_basis(kc, vc, 32) is None  # not the head dimension
    lay, _, _, _ = _filled("tq-k3v2", 64, 40)
    pre = VLLMPrefill()
    assert pre.basis(lay, 64, 512, 7168, HQ, HKV) is not None
    assert pre.basis(lay, 64, 512, 512, HQ, HKV) is None
    assert VLLMPrefill("never").basis(lay, 64, 512, 7168, HQ, HKV) is None
    sliding, _, _, _ = _filled("tq-k45v3", 64, 40, sliding_window=64)  # its history is at most 64 tokens
    assert pre.basis(sliding, 64, 512, 7168, HQ, HKV) is None
    assert VLLMPrefill("always").basis(sliding, 64, 512, 7168, HQ, HKV) is not None
    with pytest.raises(ValueError, match="rotate"):
        VLLMPrefill("sometimes")
