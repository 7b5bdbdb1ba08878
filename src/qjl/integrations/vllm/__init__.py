"""qjl inside vLLM: a compressed-KV attention backend, registered through a vLLM plugin.

Inert unless enabled: vLLM loads :func:`register` in every process (entry point
``vllm.general_plugins``), and it registers the backend only when ``QJL_VLLM_PRESET`` or
``QJL_VLLM_CONFIG`` is set (:mod:`.settings`).  Importing this package imports neither vLLM nor
transformers.  See docs/vllm.md.
"""

from __future__ import annotations

import os

from .settings import ENV_CONFIG, ENV_PRESET, VLLMSettings, enabled, load_settings

__all__ = ["register", "VLLMSettings", "load_settings", "enabled", "ENV_PRESET", "ENV_CONFIG", "BACKEND_PATH"]

BACKEND_PATH = "qjl.integrations.vllm.backend.QJLAttentionBackend"


def register() -> str | None:
    """vLLM plugin entry point: register the backend if enabled; returns the enum member's name or None.

    On CPU it overrides ``CPU_ATTN`` (the CPU platform always picks that entry for non-MLA
    models); elsewhere it registers ``CUSTOM`` (select it with ``--attention-backend CUSTOM``).
    A bad setting raises here, at engine start, naming the setting.
    """
    if not enabled():
        return None
    load_settings()  # validate the environment's part now: a bad preset fails before any model loads
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum.CPU_ATTN if current_platform.is_cpu() else AttentionBackendEnum.CUSTOM
    register_backend(member, BACKEND_PATH)
    os.environ.setdefault("QJL_VLLM_REGISTERED", member.name)
    return member.name
