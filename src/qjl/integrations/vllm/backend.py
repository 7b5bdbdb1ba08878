"""The vLLM attention backend: compressed pages, exact current chunk, paged decode kernel.

Imported only inside vLLM processes (it imports vLLM).  Per layer and step:

``forward`` (which includes the cache update, ``forward_includes_kv_cache_update``) serves a decode-only CPU step
in one C call (:func:`.fused.fused_decode`); otherwise it quantizes the
new keys and values into their pages (codes for every token, :mod:`.layout`), attends -- decode rows
in one call of :func:`.decode.decode_function`'s choice (the paged kernel of :mod:`qjl.kernels`: sinks and window exact,
codes in between, the current token exact from ``forward``'s own key/value), prefill and chunk rows
over their decoded history and their own tokens (attended exactly and causally) through vLLM's CPU attention
kernel on the CPU (:class:`.prefill.VLLMPrefill`), else :func:`.paged.paged_attention_reference` -- then
writes the exact copies of the sinks and of the exact window (:func:`.layout.window_start`; after the attention, so a
chunk never overwrites ring slots it still reads).  The step's indices are a :class:`.step.StepPlan`
built once per step and cached on the metadata, which every layer shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadata,
                                       AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata, MultipleOf)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from .layout import PageLayout, content_bytes, layer_layout
from .decode import decode_function
from .fused import fused_decode
from .paged import page_fields
from .prefill import VLLMPrefill
from .smoothing import add_value_mean, smooth_keys, smooth_values
from .step import StepPlan, forward_batch
from .writes import write_codes
from .settings import VLLMSettings, load_settings

__all__ = ["QJLAttentionBackend", "QJLAttentionImpl", "QJLMetadata", "QJLMetadataBuilder",
           "current_settings", "content_bytes", "layer_layout"]

logger = init_logger("vllm.qjl")


def current_settings() -> VLLMSettings:
    cfg = get_current_vllm_config_or_none()
    return load_settings(getattr(cfg, "additional_config", None) or {})


def _num_layers() -> int | None:
    cfg = get_current_vllm_config_or_none()
    if cfg is None or cfg.model_config is None:
        return None
    return cfg.model_config.hf_text_config.num_hidden_layers


class QJLAttentionBackend(AttentionBackend):
    """Registered over CPU_ATTN (CPU) or as CUSTOM (CUDA) by :func:`qjl.integrations.vllm.register`."""

    forward_includes_kv_cache_update: bool = True  # forward writes the codes: it has the step's metadata
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        """The registry entry this class is registered under (vLLM looks names up in its enum)."""
        from vllm.platforms import current_platform

        return "CPU_ATTN" if current_platform.is_cpu() else "CUSTOM"

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """Sliding-window layers (Mistral, hybrid Gemma-2/3-style models): their pages hold codes as any layer's; a
        token attends the window's codes and exact tokens, no sinks (:class:`.layout.PageLayout`)."""
        return True

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)  # head-major pages: one contiguous region per (block, KV head)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Our bytes per (token, KV head): the block pool is sized by them."""
        if spec.state_content_bytes is not None:
            return spec
        width = content_bytes(current_settings(), spec.head_size, spec.block_size, spec.dtype)
        return replace(spec, state_content_bytes=width)

    @staticmethod
    def get_impl_cls():
        return QJLAttentionImpl

    @staticmethod
    def get_builder_cls():
        return QJLMetadataBuilder


@dataclass
class QJLMetadata(AttentionMetadata):
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [B + 1] (CPU)
    seq_lens: torch.Tensor  # [B] tokens after this step (CPU)
    block_table: torch.Tensor  # [B, max_blocks]
    slot_mapping: torch.Tensor  # [T]
    plans: dict = field(default_factory=dict)

    def plan(self, block_size: int, sinks: int, window: int, sliding_window: int | None = None) -> StepPlan:
        """The step's :class:`.step.StepPlan`, built by the first layer that asks and shared by the others of its
        kind (hybrid models: the sliding-window layers share one, the full-attention layers another)."""
        key = (block_size, sinks, window, sliding_window)
        if key not in self.plans:
            self.plans[key] = StepPlan.build(self.query_start_loc, self.seq_lens, self.block_table, block_size, sinks,
                                             window, slot_mapping=self.slot_mapping[:self.num_actual_tokens],
                                             sliding_window=sliding_window)
        return self.plans[key]


class QJLMetadataBuilder(AttentionMetadataBuilder[QJLMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> QJLMetadata:
        m = common_attn_metadata
        return QJLMetadata(num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                           query_start_loc=m.query_start_loc_cpu.long(), seq_lens=m.seq_lens.cpu().long(),
                           block_table=m.block_table_tensor, slot_mapping=m.slot_mapping)


class QJLAttentionImpl(AttentionImpl[QJLMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, sinks=None, **kwargs):
        refuse = {"attn_type": (attn_type != AttentionType.DECODER, attn_type),
                  "alibi_slopes": (alibi_slopes is not None, "ALiBi"),
                  "sliding_window": (sliding_window is not None and (isinstance(sliding_window, bool) or not
                                                                     isinstance(sliding_window, int) or
                                                                     sliding_window < 1), sliding_window),
                  "logits_soft_cap": (bool(logits_soft_cap), logits_soft_cap),
                  "sinks": (sinks is not None, "learned attention sinks"),
                  "kv_sharing_target_layer_name": (kv_sharing_target_layer_name is not None,
                                                   kv_sharing_target_layer_name),
                  "kv_cache_dtype": (kv_cache_dtype != "auto", kv_cache_dtype)}
        for name, (bad, got) in refuse.items():
            if bad:
                raise ValueError(f"the qjl vLLM backend cannot hold this model: {name}={got!r} is not supported "
                                 "(decoder-only causal attention, full or over a sliding window of a positive int "
                                 "number of tokens, kv_cache_dtype='auto')")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.sliding_window = sliding_window  # None, or W: a token sees the W - 1 before it (no sinks kept)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.settings = current_settings()
        self.num_layers = _num_layers()
        self.layout = None
        self._fields_key = self._fields = None
        self._decode = decode_function(self.settings)
        self._fused = self.settings.decode == "auto"  # decode-only CPU steps in one C call (.fused)
        self._prefill = VLLMPrefill() if self.settings.prefill == "auto" else None  # None: torch SDPA
        s = self.settings
        logger.info_once(f"qjl backend: preset {s.preset}, {s.sink_tokens} exact sinks, exact window {s.window_tokens}, "
                         f"key smoothing {'on' if s.config.smooth_keys else 'off'}, "
                         f"value smoothing {'on' if s.config.smooth_values else 'off'}, "
                         f"decode {self._decode.__module__}.{self._decode.__name__}")

    def _layout(self, layer, kv_cache: torch.Tensor) -> PageLayout:
        if self.layout is None:
            from vllm.model_executor.models.utils import extract_layer_index

            idx = extract_layer_index(layer.layer_name)
            if self.num_layers is None or not 0 <= idx < self.num_layers:
                raise ValueError(f"the qjl backend cannot place layer {layer.layer_name!r} in a model of "
                                 f"{self.num_layers} layers")
            self.layout = layer_layout(self.settings, idx, self.num_layers, self.head_size, kv_cache.shape[2],
                                       kv_cache.dtype, sliding_window=self.sliding_window)
        return self.layout

    def _page_fields(self, layer, kv_cache: torch.Tensor) -> dict:
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if key != self._fields_key:
            self._fields = page_fields(self._layout(layer, kv_cache), kv_cache)
            self._fields_key = key
        return self._fields

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the qjl backend")
        if attn_metadata is None or kv_cache.numel() == 0:  # warm-up / profiling
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        lay, fields = self._layout(layer, kv_cache), self._page_fields(layer, kv_cache)
        plan = m.plan(lay.block_size, lay.sinks, lay.window, lay.sliding_window)
        if query.shape[0] != n:  # padded batch: its real tokens (no view per layer when there is no padding)
            query, key, value = query[:n], key[:n], value[:n]
        dst = output if output.shape[0] == n else output[:n]
        if self._fused and fused_decode(lay, fields, plan, query, key, value, self.scale, dst) is not None:
            return output  # a decode-only CPU step in one C call (smoothing, store, attention, exact copies)
        if lay.smooth_keys:  # every key of a sequence less its mean, before anything is stored or attended
            key = smooth_keys(fields, plan, key)
        mu_v = None
        if lay.smooth_values:  # the same for values, with their mean added back to the output below
            value, mu_v = smooth_values(fields, plan, query, key, value, self.scale)
        write_codes(lay, fields, key, value, None, plan=plan)
        direct = mu_v is None and dst.is_contiguous()
        out = forward_batch(lay, fields, query, key, value, m.block_table, m.query_start_loc, m.seq_lens,
                            self.scale, self._decode, plan=plan, out=dst if direct else None, prefill=self._prefill)
        if mu_v is not None:
            add_value_mean(out, mu_v)  # float32, before the output's dtype
        if out is not dst:
            dst.copy_(out)  # (converted to the output's dtype in the copy)
        return output
