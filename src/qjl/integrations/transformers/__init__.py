"""Hugging Face transformers: :class:`QJLCache` (a ``Cache`` of compressed layers) and
:func:`patch_attention` (the ``"qjl"`` attention function that reads it)."""

from qjl.integrations.transformers.attention import ATTN_NAME, patch_attention
from qjl.integrations.transformers.cache import QJLCache

__all__ = ["ATTN_NAME", "QJLCache", "patch_attention"]
